package saferetry

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

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

// TestDocLinksResolve checks that every relative link of the README and
// the guides in docs/ names a file of the repository and, with a #
// fragment, one of its headings (as GitHub makes its anchors).
func TestDocLinksResolve(t *testing.T) {
	pages, err := filepath.Glob("docs/*.md")
	require.NoError(t, err)
	pages = append(pages, "README.md")
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	anchors := map[string]map[string]bool{}
	headingsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		a := map[string]bool{}
		text, err := os.ReadFile(path)
		require.NoError(t, err)
		fence := false
		for _, line := range strings.Split(string(text), "\n") {
			if strings.HasPrefix(line, "```") {
				fence = !fence
			}
			if h, ok := strings.CutPrefix(line, "#"); ok && !fence {
				a[slug(strings.TrimLeft(h, "#"))] = true
			}
		}
		anchors[path] = a
		return a
	}
	for _, page := range pages {
		text, err := os.ReadFile(page)
		require.NoError(t, err)
		for _, m := range link.FindAllStringSubmatch(string(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, frag, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s links to %s: no such file", page, target)
				continue
			}
			if frag != "" && strings.HasSuffix(path, ".md") && !headingsOf(path)[frag] {
				t.Errorf("%s links to %s: no such heading in %s", page, target, path)
			}
		}
	}
}

// slug returns the anchor GitHub gives a heading: lower case, spaces as
// hyphens, punctuation but hyphens and underscores dropped.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
