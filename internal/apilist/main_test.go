package main

import (
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const src = `package p

import "time"

const Max = 3

type Kind string

const Fast Kind = "fast"

var ErrX error

type Config struct {
	Wait time.Duration
	Name string
	hidden int
}

func (c Config) Valid() bool { return true }
func (c *Config) set()      {}

type Doer interface{ Do(n int, rest ...string) (int, error) }

func New(cfg Config, opts ...func(*Config)) *Config { return nil }

func unexported() {}
`

func TestListPrintsEveryExportedNameOnce(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, 0)
	require.NoError(t, err)
	p, err := (&types.Config{Importer: importer.Default()}).Check("example.com/p", fset, []*ast.File{f}, nil)
	require.NoError(t, err)

	lines, n := list(p)
	assert.Equal(t, []string{
		"pkg example.com/p, const Fast Kind = \"fast\"",
		"pkg example.com/p, const Max untyped int = 3",
		"pkg example.com/p, func New(Config, ...func(*Config)) *Config",
		"pkg example.com/p, method (Config) Valid() bool",
		"pkg example.com/p, type Config struct",
		"pkg example.com/p, type Config struct, Name string",
		"pkg example.com/p, type Config struct, Wait time.Duration",
		"pkg example.com/p, type Doer interface",
		"pkg example.com/p, type Doer interface, Do(int, ...string) (int, error)",
		"pkg example.com/p, type Kind string",
		"pkg example.com/p, var ErrX error",
	}, lines)
	assert.Equal(t, counts{names: 7, methods: 2, fields: 2}, n)
}

func TestFileName(t *testing.T) {
	assert.Equal(t, "saferetry.txt", fileName("github.com/saferetry/saferetry"))
	assert.Equal(t, "idempotency_sqlstore.txt", fileName("github.com/saferetry/saferetry/idempotency/sqlstore"))
}
