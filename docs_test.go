package saferetry

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// storeList is the list of stores that the README's opening and the
// package documentation of saferetry and idempotency each state.
const storeList = "memory, SQLite (embedded), PostgreSQL, MySQL/MariaDB or Redis (standalone, Sentinel or Cluster)"

// prose returns text with comment markers and runs of white space made one
// space, so that a list wrapped at any column reads as one line.
func prose(text string) string {
	text = regexp.MustCompile(`(?m)^[ \t]*//[ \t]?`).ReplaceAllString(text, "")
	return strings.Join(strings.Fields(text), " ")
}

// TestStoreListsAgree checks that the README's opening, this package's
// documentation and package idempotency's each list every store.
func TestStoreListsAgree(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	opening, _, ok := strings.Cut(string(readme), "\n## ")
	require.True(t, ok, "README.md has no second-level heading")
	assert.Contains(t, prose(opening), storeList, "README.md's opening")
	for _, path := range []string{"doc.go", "idempotency/doc.go"} {
		src, err := os.ReadFile(path)
		require.NoError(t, err)
		comment, _, ok := strings.Cut(string(src), "\npackage ")
		require.True(t, ok, "%s has no package clause", path)
		assert.Contains(t, prose(comment), storeList, path)
	}
}

// TestREADMEInstallsEveryLibraryModule checks that the README's install
// lines hold a replace line for every module of go.work that a user
// imports: all but the examples, the benchmarks and the linearizability
// tests.
func TestREADMEInstallsEveryLibraryModule(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	_, block, ok := strings.Cut(string(readme), "<!-- begin install: go.mod -->\n")
	require.True(t, ok, "README.md has no install lines")
	block, _, ok = strings.Cut(block, "<!-- end install: go.mod -->\n")
	require.True(t, ok, "README.md's install lines have no end marker")
	work, err := os.ReadFile("go.work")
	require.NoError(t, err)
	modules := regexp.MustCompile(`(?m)^\s*\./(\S+)\s*$`).FindAllStringSubmatch(string(work), -1)
	require.NotEmpty(t, modules, "go.work uses no nested module")
	assert.Contains(t, block, "\tgithub.com/saferetry/saferetry => ../saferetry\n")
	for _, m := range modules {
		dir := m[1]
		switch {
		case dir == "bench", dir == "linearizability", dir == "examples", strings.HasPrefix(dir, "examples/"):
			assert.NotContains(t, block, "saferetry/"+dir+" ", "a user imports no %s", dir)
		default:
			assert.Contains(t, block, "\tgithub.com/saferetry/saferetry/"+dir+" => ../saferetry/"+dir+"\n",
				"README.md's install lines give no replace line for module %s", dir)
		}
	}
}
