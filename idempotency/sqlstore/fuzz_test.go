package sqlstore_test

import (
	"database/sql"
	"errors"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// FuzzWithTable checks that any table name either is rejected with
// ErrInvalidConfig or is a plain identifier that appears verbatim in the
// DDL, so that no name can smuggle SQL into the statements.
func FuzzWithTable(f *testing.F) {
	for _, s := range []string{"idempotency_records", "", "a;b", "x y", `"q"`, "s.t", "_1", "1a", "é", strings.Repeat("z", 60)} {
		f.Add(s)
	}
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(f.TempDir(), "fuzz.db")))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = db.Close() })
	f.Fuzz(func(t *testing.T, name string) {
		s, err := sqlstore.Open(db, sqlstore.SQLite, sqlstore.WithTable(name))
		if err != nil {
			if !errors.Is(err, sqlstore.ErrInvalidConfig) {
				t.Fatalf("Open(%q): %v, want ErrInvalidConfig", name, err)
			}
			return
		}
		if name == "" || len(name) > 48 || name[0] >= '0' && name[0] <= '9' {
			t.Fatalf("accepted %q", name)
		}
		for _, r := range name {
			if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
				t.Fatalf("accepted %q with %q", name, r)
			}
		}
		if !strings.Contains(s.Schema(), "CREATE TABLE IF NOT EXISTS "+name+" (") {
			t.Fatalf("schema does not name %q", name)
		}
	})
}

// FuzzSQLiteDSN checks that no path can add, drop or change the DSN's
// parameters: the query is always the recommended one, and the path part
// decodes back to the path.
func FuzzSQLiteDSN(f *testing.F) {
	for _, s := range []string{"idem.db", "/tmp/a b.db", "x?_txlock=deferred", "x#frag", "100%.db", "&_pragma=foo"} {
		f.Add(s)
	}
	want := sqlstore.SQLiteDSN("x")
	_, wantQuery, _ := strings.Cut(want, "?")
	f.Fuzz(func(t *testing.T, path string) {
		dsn := sqlstore.SQLiteDSN(path)
		p, q, ok := strings.Cut(dsn, "?")
		if !ok || q != wantQuery {
			t.Fatalf("SQLiteDSN(%q) = %q: query changed", path, dsn)
		}
		if strings.Contains(p, "#") {
			t.Fatalf("SQLiteDSN(%q) = %q: fragment in path", path, dsn)
		}
		dec, err := url.PathUnescape(strings.TrimPrefix(p, "file:"))
		if err != nil || dec != path {
			t.Fatalf("SQLiteDSN(%q) path decodes to %q (%v)", path, dec, err)
		}
	})
}
