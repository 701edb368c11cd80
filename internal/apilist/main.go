// Command apilist writes or checks the listing of the exported API of every
// library package, one file per package in api/, so that every change to the
// API shows up in review (as the Go project's api/ files do).
//
//	go run ./internal/apilist          # check: exit 1 if the code and api/ differ
//	go run ./internal/apilist -w       # write api/ from the code
//	go run ./internal/apilist -count   # exported names, methods and fields per package
//
// It runs from the root of the repository in workspace mode and reads the
// packages' export data (go list -export), so it needs only the standard
// library. The library packages are every non-main package of the modules
// below, except internal ones.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// patterns are the library modules' packages (examples and bench are not
// libraries).
var patterns = []string{
	"./...", "./idempotency/sqlstore/...", "./idempotency/redisstore/...", "./otelsaferetry/...",
	"./idempotency/natsconsumer/...", "./idempotency/amqpconsumer/...",
}

const (
	module = "github.com/saferetry/saferetry"
	dir    = "api"
)

func main() {
	write := flag.Bool("w", false, "write api/ instead of checking it")
	count := flag.Bool("count", false,
		"print the exported names, methods and fields of each package")
	flag.Parse()
	if err := run(*write, *count, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "apilist:", err)
		os.Exit(1)
	}
}

func run(write, count bool, out io.Writer) error {
	pkgs, exports, err := load()
	if err != nil {
		return err
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})
	want := map[string]bool{}
	var stale []string
	for _, path := range pkgs {
		p, err := imp.Import(path)
		if err != nil {
			return err
		}
		lines, n := list(p)
		if count {
			fmt.Fprintf(out, "%-50s %4d names %4d methods %4d fields\n",
				path, n.names, n.methods, n.fields)
			continue
		}
		file := filepath.Join(dir, fileName(path))
		want[file] = true
		text := []byte(strings.Join(lines, "\n") + "\n")
		old, _ := os.ReadFile(file)
		if bytes.Equal(old, text) {
			continue
		}
		if write {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(file, text, 0o644); err != nil {
				return err
			}
			continue
		}
		stale = append(stale, diff(file, old, text))
	}
	if count {
		return nil
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.txt"))
	for _, f := range files {
		if want[f] {
			continue
		}
		if write {
			if err := os.Remove(f); err != nil {
				return err
			}
			continue
		}
		stale = append(stale, f+": no such library package")
	}
	if len(stale) > 0 {
		return fmt.Errorf("the exported API differs from api/ "+
			"(run go run ./internal/apilist -w and review the diff):\n%s",
			strings.Join(stale, "\n"))
	}
	return nil
}

// load returns the library packages' import paths and the export data file
// of every package they depend on.
func load() ([]string, map[string]string, error) {
	args := append([]string{"list", "-export", "-deps", "-f",
		"{{.ImportPath}}\t{{.Export}}\t{{.Name}}\t{{.DepOnly}}"}, patterns...)
	cmd := exec.Command("go", args...)
	cmd.Stderr = os.Stderr
	b, err := cmd.Output()
	if err != nil {
		return nil, nil, fmt.Errorf("go list: %w", err)
	}
	exports := map[string]string{}
	var pkgs []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 4 {
			return nil, nil, fmt.Errorf("go list: unexpected line %q", line)
		}
		path, export, name, depOnly := f[0], f[1], f[2], f[3] == "true"
		exports[path] = export
		if !depOnly && name != "main" && !strings.Contains(path+"/", "/internal/") {
			pkgs = append(pkgs, path)
		}
	}
	slices.Sort(pkgs)
	return pkgs, exports, nil
}

// fileName is the listing's file name: the path inside the module, with
// slashes as underscores ("saferetry.txt" for the root package).
func fileName(path string) string {
	rel := strings.TrimPrefix(strings.TrimPrefix(path, module), "/")
	if rel == "" {
		rel = "saferetry"
	}
	return strings.ReplaceAll(rel, "/", "_") + ".txt"
}

type counts struct{ names, methods, fields int }

// list returns the sorted lines of p's exported API.
func list(p *types.Package) ([]string, counts) {
	var n counts
	qual := func(q *types.Package) string {
		if q == p {
			return ""
		}
		return q.Name()
	}
	typ := func(t types.Type) string { return types.TypeString(t, qual) }
	prefix := "pkg " + p.Path() + ", "
	var lines []string
	add := func(s string) { lines = append(lines, prefix+s) }
	scope := p.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		n.names++
		switch o := obj.(type) {
		case *types.Const:
			add(fmt.Sprintf("const %s %s = %s", name, typ(o.Type()), o.Val().ExactString()))
		case *types.Var:
			add(fmt.Sprintf("var %s %s", name, typ(o.Type())))
		case *types.Func:
			add("func " + name + signature(o.Type().(*types.Signature), typ))
		case *types.TypeName:
			under := o.Type().Underlying()
			tparams := ""
			if named, ok := o.Type().(*types.Named); ok && named.TypeParams().Len() > 0 {
				var ps []string
				for i := range named.TypeParams().Len() {
					tp := named.TypeParams().At(i)
					ps = append(ps, tp.Obj().Name()+" "+typ(tp.Constraint()))
				}
				tparams = "[" + strings.Join(ps, ", ") + "]"
			}
			head := "type " + name + tparams
			if o.IsAlias() {
				add(head + " = " + typ(o.Type()))
				continue
			}
			switch u := under.(type) {
			case *types.Struct:
				add(head + " struct")
				for i := range u.NumFields() {
					f := u.Field(i)
					if !f.Exported() {
						continue
					}
					n.fields++
					if f.Embedded() {
						add(fmt.Sprintf("%s struct, embedded %s", head, typ(f.Type())))
					} else {
						add(fmt.Sprintf("%s struct, %s %s", head, f.Name(), typ(f.Type())))
					}
				}
			case *types.Interface:
				add(head + " interface")
				for i := range u.NumExplicitMethods() {
					m := u.ExplicitMethod(i)
					if m.Exported() {
						n.methods++
						sig := signature(m.Type().(*types.Signature), typ)
						add(fmt.Sprintf("%s interface, %s%s", head, m.Name(), sig))
					}
				}
				for i := range u.NumEmbeddeds() {
					add(fmt.Sprintf("%s interface, embedded %s", head, typ(u.EmbeddedType(i))))
				}
			default:
				add(head + " " + typ(under))
			}
			if named, ok := o.Type().(*types.Named); ok {
				for i := range named.NumMethods() {
					m := named.Method(i)
					if !m.Exported() || types.IsInterface(named) {
						continue
					}
					n.methods++
					sig := m.Type().(*types.Signature)
					recv := name
					if _, ptr := sig.Recv().Type().(*types.Pointer); ptr {
						recv = "*" + name
					}
					add(fmt.Sprintf("method (%s) %s%s", recv, m.Name(), signature(sig, typ)))
				}
			}
		}
	}
	slices.Sort(lines)
	return lines, n
}

// signature prints sig without parameter names, as Go's api files do.
func signature(sig *types.Signature, typ func(types.Type) string) string {
	tuple := func(t *types.Tuple, variadic bool) []string {
		var s []string
		for i := range t.Len() {
			v := t.At(i).Type()
			if variadic && i == t.Len()-1 {
				s = append(s, "..."+typ(v.(*types.Slice).Elem()))
				continue
			}
			s = append(s, typ(v))
		}
		return s
	}
	var b strings.Builder
	if tp := sig.TypeParams(); tp != nil && tp.Len() > 0 {
		var ps []string
		for i := range tp.Len() {
			ps = append(ps, tp.At(i).Obj().Name()+" "+typ(tp.At(i).Constraint()))
		}
		b.WriteString("[" + strings.Join(ps, ", ") + "]")
	}
	b.WriteString("(" + strings.Join(tuple(sig.Params(), sig.Variadic()), ", ") + ")")
	res := tuple(sig.Results(), false)
	switch len(res) {
	case 0:
	case 1:
		b.WriteString(" " + res[0])
	default:
		b.WriteString(" (" + strings.Join(res, ", ") + ")")
	}
	return b.String()
}

// diff describes how the listing of file changes: the lines removed and added.
func diff(file string, old, text []byte) string {
	was := strings.Split(strings.TrimSpace(string(old)), "\n")
	now := strings.Split(strings.TrimSpace(string(text)), "\n")
	var b strings.Builder
	fmt.Fprintf(&b, "%s:\n", file)
	for _, l := range was {
		if l != "" && !slices.Contains(now, l) {
			fmt.Fprintf(&b, "  - %s\n", l)
		}
	}
	for _, l := range now {
		if !slices.Contains(was, l) {
			fmt.Fprintf(&b, "  + %s\n", l)
		}
	}
	return strings.TrimRight(b.String(), "\n")
}
