package sqlstore_test

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

const pgSkip = "SAFERETRY_PG_DSN not set: skipping PostgreSQL tests"

// backend opens a fresh, isolated database for one test.
type backend struct {
	name    string
	dialect sqlstore.Dialect
	open    func(t testing.TB) *sql.DB
}

var backends = []backend{
	{name: "sqlite", dialect: sqlstore.SQLite, open: openSQLite},
	{name: "postgres", dialect: sqlstore.Postgres, open: openPG},
	{name: "mysql", dialect: sqlstore.MySQL, open: openMySQL}, // MariaDB in CI
}

// forEach runs f once per dialect in a subtest, each on its own database.
func forEach(t *testing.T, f func(t *testing.T, b backend)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { f(t, b) })
	}
}

// forEachServer runs f as forEach does, on the dialects with a server
// (PostgreSQL and MySQL), for what an embedded database does not have.
func forEachServer(t *testing.T, f func(t *testing.T, b backend)) {
	for _, b := range backends {
		if b.dialect != sqlstore.SQLite {
			t.Run(b.name, func(t *testing.T) { f(t, b) })
		}
	}
}

// openSQLite opens a new SQLite database file in the test's temp dir with the
// recommended DSN.
func openSQLite(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "idem.db")))
	require.NoError(t, err)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return db
}

// pgDSN returns SAFERETRY_PG_DSN or skips the test; with
// SAFERETRY_REQUIRE_PG set (CI), a missing DSN fails the test instead.
func pgDSN(t testing.TB) string {
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_PG") != "" {
			t.Fatal("SAFERETRY_PG_DSN not set but SAFERETRY_REQUIRE_PG is")
		}
		t.Skip(pgSkip)
	}
	return dsn
}

// openPG creates a fresh schema for the test and returns a pool whose
// search_path points at it, so tables (the store's and the test's business
// tables) never collide with other tests or runs. The schema is dropped at
// cleanup.
func openPG(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", pgSchemaDSN(t))
	require.NoError(t, err)
	db.SetMaxOpenConns(20)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return db
}

// pgSchemaDSN creates a fresh schema for the test, dropped at cleanup, and
// returns SAFERETRY_PG_DSN with a search_path that points at it.
func pgSchemaDSN(t testing.TB) string {
	t.Helper()
	dsn := pgDSN(t)
	schema := "t_" + randHex(8)
	admin, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	_, err = admin.Exec("CREATE SCHEMA " + schema)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + schema + " CASCADE") })
	return withParam(dsn, "search_path", schema)
}

// withParam appends a query parameter to a URL-style DSN.
func withParam(dsn, k, v string) string {
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	return dsn + sep + k + "=" + v
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newStore opens a migrated store on a fresh database of b's dialect.
func newStore(t testing.TB, b backend, opts ...sqlstore.Option) (*sqlstore.Store, *sql.DB) {
	t.Helper()
	db := b.open(t)
	s, err := sqlstore.Open(db, b.dialect, opts...)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	return s, db
}

// claimed unpacks a Claim's result as (record, acquired, error).
func claimed(res idempotency.ClaimResult, err error) (idempotency.Record, bool, error) {
	return res.Record, res.Acquired(), err
}
