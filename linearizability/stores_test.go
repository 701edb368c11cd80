package linearizability

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// storeCase is one store under the check: one entry of stores.
type storeCase struct {
	name string
	// open makes a fresh store, isolated from every other test and run,
	// and says which faults it can take.
	open func(t *testing.T) *backend
	// reopen opens, in a child process, the store that backend.shared
	// names; nil when the store's state lives in one process.
	reopen func(shared string) (idempotency.Store, func(), error)
	// oneTx: a third of the workers' claims are requests in one
	// transaction (idempotency.ClaimTransactor.ClaimInUnit, then the
	// unit's completion and commit, or its rollback).
	oneTx bool
}

// stores are the stores the check runs on. Adding a store is one entry: a
// function that opens a fresh store (and, for a networked one, a second
// handle through toxiproxy and a way to kill one of its connections), and
// one that opens the same store again in a child process.
var stores = []storeCase{
	{name: "memory", open: openMemory},
	{name: "sqlite", open: openSQLite, reopen: reopenSQLite},
	{name: "postgres", open: openPostgres, reopen: reopenPostgres},
	{name: "mysql", open: openMySQL, reopen: reopenMySQL},
	{name: "sqlite-onetx", open: openSQLite, reopen: reopenSQLite, oneTx: true},
	{name: "postgres-onetx", open: openPostgres, reopen: reopenPostgres, oneTx: true},
	{name: "mysql-onetx", open: openMySQL, reopen: reopenMySQL, oneTx: true},
	{name: "redis", open: openRedis, reopen: reopenRedis},
	{name: "redis-cluster", open: openRedisCluster, reopen: reopenRedis},
}

// backend is one fresh store and the faults it can take.
type backend struct {
	store idempotency.Store
	// evicts: the store deletes completed records past their replay
	// window on its own (see model.evicts).
	evicts bool

	// faulty is a second handle on the same records whose connections go
	// through proxies, in-process toxiproxies (one per server); nil for a
	// store without a network.
	faulty  idempotency.Store
	proxies []*toxiproxy.Proxy
	// killConn terminates, server side, one connection of store or faulty
	// that is running a statement; nil when there is none to kill.
	killConn func(ctx context.Context) (bool, error)

	// shared is what a child process gives stores' reopen to open the same
	// records; "" when the state lives in this process.
	shared string

	// faultRounds is how many times the faults phase runs, each on fresh
	// keys, its history checked on its own and its coverage counted with
	// the others' (0 means once): a store whose calls take tens of
	// microseconds gets through one in a fraction of a second, with few
	// faults.
	faultRounds int
}

func openMemory(*testing.T) *backend {
	return &backend{store: memstore.New(), evicts: true}
}

func openSQLite(t *testing.T) *backend {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, closeDB, err := reopenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeDB)
	if err := s.(*sqlstore.Store).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return &backend{store: s, shared: path}
}

func reopenSQLite(path string) (idempotency.Store, func(), error) {
	return openSQL("sqlite", sqlstore.SQLiteDSN(path), sqlstore.SQLite, 8)
}

// openSQL opens a store of dialect d on a new pool of at most conns
// connections.
func openSQL(driver, dsn string, d sqlstore.Dialect, conns int) (idempotency.Store, func(), error) {
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return nil, nil, err
	}
	db.SetMaxOpenConns(conns)
	s, err := sqlstore.Open(db, d)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	return s, func() { _ = db.Close() }, nil
}

const pgSkip = "SAFERETRY_PG_DSN not set: skipping the PostgreSQL check"

// pgDSN returns SAFERETRY_PG_DSN or skips t; with SAFERETRY_REQUIRE_PG set
// (CI), a missing DSN fails t instead.
func pgDSN(t *testing.T) string {
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_PG") != "" {
			t.Fatal("SAFERETRY_PG_DSN not set but SAFERETRY_REQUIRE_PG is")
		}
		t.Skip(pgSkip)
	}
	return dsn
}

// openPostgres makes a fresh schema, dropped at cleanup, and two pools on
// it: one direct, one through toxiproxy. Both carry an application_name of
// their own, by which killConn finds their backends.
func openPostgres(t *testing.T) *backend {
	dsn := pgDSN(t)
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		t.Fatalf("SAFERETRY_PG_DSN must be a postgres:// URL with a host: %q", dsn)
	}
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	id := randHex(6)
	schema, app := "lin_"+id, "lincheck_"+id
	if _, err := admin.ExecContext(t.Context(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + schema + " CASCADE") })

	q := u.Query()
	q.Set("search_path", schema)
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	shared := u.String()
	s, closeDirect, err := openSQL("pgx", shared, sqlstore.Postgres, 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeDirect)
	if err := s.(*sqlstore.Store).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}

	proxy := startProxy(t, u.Host)
	u.Host = proxy.Listen
	faulty, closeFaulty, err := openSQL("pgx", u.String(), sqlstore.Postgres, 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeFaulty)

	kill := func(ctx context.Context) (bool, error) {
		var n int
		err := admin.QueryRowContext(ctx, `SELECT count(pg_terminate_backend(pid)) FROM (
	SELECT pid FROM pg_stat_activity
	WHERE application_name = $1 AND state = 'active' AND pid <> pg_backend_pid()
	ORDER BY random() LIMIT 1) a`, app).Scan(&n)
		return n > 0, err
	}
	return &backend{store: s, faulty: faulty, proxies: []*toxiproxy.Proxy{proxy}, killConn: kill,
		shared: shared}
}

func reopenPostgres(dsn string) (idempotency.Store, func(), error) {
	return openSQL("pgx", dsn, sqlstore.Postgres, 8)
}

// startProxy starts an in-process toxiproxy from a loopback port to
// upstream, stopped at cleanup.
func startProxy(t *testing.T, upstream string) *toxiproxy.Proxy {
	p := toxiproxy.NewProxy(newToxiproxyServer(), "lincheck", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	return p
}

// newToxiproxyServer returns the toxiproxy API server that owns a proxy,
// logging nowhere. toxiproxy.NewServer takes a zerolog.Logger, which go.mod
// lists only as an indirect dependency: this derives the logger type from
// NewServer's signature and asks a zero Logger for one that discards.
func newToxiproxyServer() *toxiproxy.ApiServer {
	return withDiscardLogger(toxiproxy.NewServer, toxiproxy.NewMetricsContainer(nil))
}

func withDiscardLogger[M any, L interface{ Output(io.Writer) L }](
	newServer func(M, L) *toxiproxy.ApiServer, m M) *toxiproxy.ApiServer {
	var zero L
	return newServer(m, zero.Output(io.Discard))
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func lookupStore(name string) (storeCase, error) {
	for _, sc := range stores {
		if sc.name == name {
			return sc, nil
		}
	}
	return storeCase{}, errors.New("no store named " + name)
}
