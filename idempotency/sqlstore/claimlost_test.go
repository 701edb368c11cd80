package sqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
	"modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// claimCut is a database, per dialect, whose next statement with an
// INSERT, once armed, runs to its end and commits, and whose answer is
// then lost (cutClaims; on PostgreSQL a proxy, newPGCutter); cuts counts
// the answers lost.
type claimCut struct {
	name    string
	dialect sqlstore.Dialect
	open    func(t *testing.T) (db *sql.DB, arm func(), cuts func() int32)
}

// claimCuts returns a claimCut for each dialect.
func claimCuts() []claimCut {
	return []claimCut{
		{"sqlite", sqlstore.SQLite, func(t *testing.T) (*sql.DB, func(), func() int32) {
			dsn := sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "idem.db"))
			c := &cutClaims{open: func() (driver.Conn, error) {
				return (&sqlite.Driver{}).Open(dsn)
			}, driver: &sqlite.Driver{}, keepOpen: true}
			return cutDB(t, c), func() { c.armed.Store(true) }, c.cuts.Load
		}},
		{"postgres", sqlstore.Postgres, func(t *testing.T) (*sql.DB, func(), func() int32) {
			dsn := withParam(pgSchemaDSN(t), "default_query_exec_mode", "exec")
			cutter, viaProxy := newPGCutter(t, dsn, func(typ byte, body []byte) bool {
				return (typ == 'P' || typ == 'Q') && bytes.Contains(body, []byte("INSERT INTO"))
			})
			return pgPool(t, viaProxy, 4), func() { cutter.armed.Store(true) }, cutter.cuts.Load
		}},
		{"mysql", sqlstore.MySQL, func(t *testing.T) (*sql.DB, func(), func() int32) {
			connector, err := mysql.NewConnector(mysqlDatabaseConfig(t))
			require.NoError(t, err)
			rebinding := mysqlTestConnector{Connector: connector} // the tests' $N
			c := &cutClaims{open: func() (driver.Conn, error) {
				return rebinding.Connect(context.Background())
			}, driver: connector.Driver()}
			return cutDB(t, c), func() { c.armed.Store(true) }, c.cuts.Load
		}},
	}
}

// A claim whose answer is lost: the database runs the claim's INSERT and
// commits it, then the connection dies before the answer reaches the
// client. The middleware reads the record back: it holds the claim's owner
// token, so the request (or the call of Do) runs, once, and is stored; the
// retry gets the replay, not 409 for a lease that nobody holds
// (idempotencytest.TestClaimAnswerLost). On PostgreSQL a proxy cuts the
// connection after the server answered the claim's statement; on MySQL the
// driver's connection (its socket) is closed after the statement ran to its
// end; on SQLite, whose file no fault cuts on demand, the driver reports
// the loss after the statement ran and the pool discards the connection
// (cutClaims).
func TestClaimWhoseAnswerIsLost(t *testing.T) {
	for _, tc := range claimCuts() {
		t.Run(tc.name, func(t *testing.T) {
			db, arm, cuts := tc.open(t)
			s, err := sqlstore.Open(db, tc.dialect)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			idempotencytest.TestClaimAnswerLost(t, s, arm, func() int64 { return int64(cuts()) })
		})
	}
}

// cutClaims is a database/sql connector whose connections, once armed,
// run the next statement with an INSERT (a claim's first statement) to its
// end, committed, then close the driver's connection (its socket; with
// keepOpen, it is left to the pool, which discards it: a SQLite
// connection closed under its prepared statements crashes the driver) and
// report the loss as a driver does: the statement happened, its answer is
// gone.
type cutClaims struct {
	open     func() (driver.Conn, error)
	driver   driver.Driver
	keepOpen bool
	armed    atomic.Bool
	cuts     atomic.Int32
}

var errClaimCut = errors.New("the connection died after the statement ran (injected)")

func (c *cutClaims) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.open()
	if err != nil {
		return nil, err
	}
	return &cutConn{Conn: conn, c: c}, nil
}

func (c *cutClaims) Driver() driver.Driver { return c.driver }

// cutDB opens a pool over c.
func cutDB(t *testing.T, c *cutClaims) *sql.DB {
	t.Helper()
	db := sql.OpenDB(c)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return db
}

// cutConn passes every call to the driver's connection, whose interfaces
// database/sql uses, and cuts it after an armed claim.
type cutConn struct {
	driver.Conn
	c    *cutClaims
	dead bool
}

// cut reports whether query is the armed claim's.
func (f *cutConn) cut(query string) bool {
	return strings.Contains(query, "INSERT") && f.c.armed.CompareAndSwap(true, false)
}

// kill closes the connection after the claim ran, and returns its error.
func (f *cutConn) kill() error {
	f.dead = true
	f.c.cuts.Add(1)
	if !f.c.keepOpen {
		_ = f.Conn.Close()
	}
	return errClaimCut
}

func (f *cutConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	st, err := f.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return &cutStmt{Stmt: st, conn: f, query: query}, nil
}

func (f *cutConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return f.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (f *cutConn) ExecContext(ctx context.Context, query string,
	args []driver.NamedValue) (driver.Result, error) {
	res, err := f.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	if err == nil && f.cut(query) {
		return nil, f.kill()
	}
	return res, err
}

func (f *cutConn) QueryContext(ctx context.Context, query string,
	args []driver.NamedValue) (driver.Rows, error) {
	rows, err := f.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	if err == nil && f.cut(query) {
		drain(rows)
		return nil, f.kill()
	}
	return rows, err
}

func (f *cutConn) CheckNamedValue(nv *driver.NamedValue) error {
	if c, ok := f.Conn.(driver.NamedValueChecker); ok {
		return c.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (f *cutConn) Ping(ctx context.Context) error { return f.Conn.(driver.Pinger).Ping(ctx) }

func (f *cutConn) ResetSession(ctx context.Context) error {
	if f.dead {
		return driver.ErrBadConn
	}
	if r, ok := f.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (f *cutConn) IsValid() bool {
	if v, ok := f.Conn.(driver.Validator); ok {
		return !f.dead && v.IsValid()
	}
	return !f.dead
}

// drain reads rows to their end, so that the statement ran to its end
// (and, outside a transaction, committed), and closes them.
func drain(rows driver.Rows) {
	dest := make([]driver.Value, len(rows.Columns()))
	for rows.Next(dest) == nil {
	}
	_ = rows.Close()
}

// cutStmt is a prepared statement of a cutConn.
type cutStmt struct {
	driver.Stmt
	conn  *cutConn
	query string
}

func (s *cutStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result,
	error) {
	res, err := s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
	if err == nil && s.conn.cut(s.query) {
		return nil, s.conn.kill()
	}
	return res, err
}

func (s *cutStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows,
	error) {
	rows, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err == nil && s.conn.cut(s.query) {
		drain(rows)
		return nil, s.conn.kill()
	}
	return rows, err
}

func (s *cutStmt) CheckNamedValue(nv *driver.NamedValue) error {
	return s.conn.CheckNamedValue(nv)
}
