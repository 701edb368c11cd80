package sqlstore_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
)

const mysqlSkip = "SAFERETRY_MYSQL_DSN not set: skipping MySQL tests"

// mysqlDSN returns SAFERETRY_MYSQL_DSN (a go-sql-driver/mysql DSN such as
// root@tcp(127.0.0.1:3306)/test) or skips the test; with
// SAFERETRY_REQUIRE_MYSQL set (CI), a missing DSN fails the test instead.
func mysqlDSN(t testing.TB) string {
	t.Helper()
	dsn := os.Getenv("SAFERETRY_MYSQL_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_MYSQL") != "" {
			t.Fatal("SAFERETRY_MYSQL_DSN not set but SAFERETRY_REQUIRE_MYSQL is")
		}
		t.Skip(mysqlSkip)
	}
	return dsn
}

// mysqlDatabaseConfig creates a fresh database t_<random> for the test on
// the server of SAFERETRY_MYSQL_DSN, dropped at cleanup (other tests and
// sessions share the server), and returns the DSN's configuration with that
// database selected.
func mysqlDatabaseConfig(t testing.TB) *mysql.Config {
	t.Helper()
	cfg, err := mysql.ParseDSN(mysqlDSN(t))
	require.NoError(t, err)
	admin, err := sql.Open("mysql", cfg.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	name := "t_" + randHex(8)
	_, err = admin.Exec("CREATE DATABASE " + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE " + name) })
	cfg.DBName = name
	return cfg
}

// mysqlDatabaseDSN is mysqlDatabaseConfig as a DSN, for a process of its
// own.
func mysqlDatabaseDSN(t testing.TB) string {
	t.Helper()
	return mysqlDatabaseConfig(t).FormatDSN()
}

// openMySQL opens a pool on a fresh database (mysqlDatabaseConfig) through
// the real driver, whose connections turn the $N placeholders that the
// tests' own SQL is written with into MySQL's ? (see mysqlTestConnector).
func openMySQL(t testing.TB) *sql.DB {
	t.Helper()
	return openMySQLConfig(t, mysqlDatabaseConfig(t), nil)
}

// openMySQLConfig opens a pool over cfg, recording its statements in log
// when log is not nil.
func openMySQLConfig(t testing.TB, cfg *mysql.Config, log *stmtLog) *sql.DB {
	t.Helper()
	c, err := mysql.NewConnector(cfg)
	require.NoError(t, err)
	check := &mysqlPool{}
	db := sql.OpenDB(mysqlTestConnector{Connector: c, log: log, check: check})
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	check.db = db
	mysqlPools.Store(db, check)
	t.Cleanup(func() {
		mysqlPools.Delete(db)
		_ = db.Close()
	})
	require.NoError(t, db.Ping())
	return db
}

// mysqlPools maps the pools of openMySQLConfig to their hooks.
var mysqlPools sync.Map // *sql.DB -> *mysqlPool

// mysqlPool is what the test connections of one pool share: the count of
// the InnoDB deadlocks (1213) and lock wait timeouts (1205) the server
// answered them, and a check that stands in for the deferred constraints
// MySQL lacks: a query run in each transaction just before its COMMIT (a
// count of violating rows); when it counts any, the session is killed from
// another connection of the pool before the COMMIT is sent, so that the
// COMMIT fails for real, as a deferred constraint fails it on SQLite and
// PostgreSQL.
type mysqlPool struct {
	db                      *sql.DB
	deadlocks, lockTimeouts atomic.Int64
	mu                      sync.Mutex
	query                   string
}

// poolOf returns the hooks of a pool of openMySQLConfig.
func poolOf(t testing.TB, db *sql.DB) *mysqlPool {
	t.Helper()
	p, ok := mysqlPools.Load(db)
	require.True(t, ok, "not a pool of openMySQLConfig")
	return p.(*mysqlPool)
}

// saw counts err if it is a deadlock or a lock wait timeout.
func (p *mysqlPool) saw(err error) {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		switch me.Number {
		case 1213:
			p.deadlocks.Add(1)
		case 1205:
			p.lockTimeouts.Add(1)
		}
	}
}

// checkAtCommit makes every later COMMIT on db's connections run query
// first (see mysqlPool).
func checkAtCommit(t testing.TB, db *sql.DB, query string) {
	t.Helper()
	check := poolOf(t, db)
	check.mu.Lock()
	defer check.mu.Unlock()
	check.query = query
}

// before runs the check in the transaction of conn, whose session is id,
// and kills the session if it fails.
func (c *mysqlPool) before(conn driver.Conn, id int64) error {
	c.mu.Lock()
	q := c.query
	c.mu.Unlock()
	if q == "" {
		return nil
	}
	rows, err := conn.(driver.QueryerContext).QueryContext(context.Background(), q, nil)
	if err != nil {
		return err
	}
	v := make([]driver.Value, 1)
	err = rows.Next(v)
	_ = rows.Close()
	if err != nil {
		return err
	}
	if n, _ := strconv.ParseInt(fmt.Sprint(asString(v[0])), 10, 64); n == 0 {
		return nil
	}
	_, err = c.db.Exec(`KILL CONNECTION ?`, id)
	return err
}

func asString(v driver.Value) string {
	if b, ok := v.([]byte); ok {
		return string(b)
	}
	return fmt.Sprint(v)
}

// mysqlRebind turns the $1, $2, ... placeholders of a test's query into
// ?. They must appear in their numbers' order, each once: ? binds by
// position. The Store's own statements have no $ and pass unchanged.
func mysqlRebind(q string) string {
	if !strings.Contains(q, "$") {
		return q
	}
	var b strings.Builder
	next := 1
	for i := 0; i < len(q); i++ {
		if q[i] != '$' {
			b.WriteByte(q[i])
			continue
		}
		j := i + 1
		for j < len(q) && q[j] >= '0' && q[j] <= '9' {
			j++
		}
		n, err := strconv.Atoi(q[i+1 : j])
		if err != nil || n != next {
			panic(fmt.Sprintf("mysqlRebind: placeholder %q out of order in %q", q[i:j], q))
		}
		next++
		b.WriteByte('?')
		i = j - 1
	}
	return b.String()
}

// mysqlTestConnector wraps go-sql-driver/mysql's connector: its connections
// rewrite the tests' $N placeholders (mysqlRebind) and, with a log, record
// every statement executed (not the preparations), BEGIN, COMMIT and
// ROLLBACK. Everything else is the driver's own.
type mysqlTestConnector struct {
	driver.Connector
	log   *stmtLog
	check *mysqlPool
}

func (c mysqlTestConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := conn.(driver.QueryerContext).QueryContext(ctx, `SELECT CONNECTION_ID()`, nil)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	v := make([]driver.Value, 1)
	err = rows.Next(v)
	_ = rows.Close()
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	id, err := strconv.ParseInt(asString(v[0]), 10, 64)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &mysqlTestConn{Conn: conn, log: c.log, check: c.check, id: id}, nil
}

type mysqlTestConn struct {
	driver.Conn
	log   *stmtLog
	check *mysqlPool
	id    int64 // the server's CONNECTION_ID()
}

func (c *mysqlTestConn) add(q string, err error) {
	c.check.saw(err)
	if c.log != nil && err != driver.ErrSkip {
		c.log.add(q)
		c.log.ran()
	}
}

func (c *mysqlTestConn) Prepare(q string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), q)
}

func (c *mysqlTestConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	q = mysqlRebind(q)
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return st, err
	}
	return &mysqlTestStmt{Stmt: st, q: q, c: c}, nil
}

func (c *mysqlTestConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (
	driver.Result, error) {
	q = mysqlRebind(q)
	res, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
	c.add(q, err)
	return res, err
}

func (c *mysqlTestConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (
	driver.Rows, error) {
	q = mysqlRebind(q)
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
	c.add(q, err)
	return rows, err
}

func (c *mysqlTestConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *mysqlTestConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	c.add("BEGIN", err)
	if err != nil {
		return tx, err
	}
	return &mysqlTestTx{Tx: tx, c: c}, nil
}

type mysqlTestTx struct {
	driver.Tx
	c *mysqlTestConn
}

func (t *mysqlTestTx) Commit() error {
	if t.c.check != nil {
		if err := t.c.check.before(t.c.Conn, t.c.id); err != nil {
			return err
		}
	}
	err := t.Tx.Commit()
	t.c.add("COMMIT", err)
	return err
}

func (t *mysqlTestTx) Rollback() error {
	err := t.Tx.Rollback()
	t.c.add("ROLLBACK", err)
	return err
}

func (c *mysqlTestConn) Ping(ctx context.Context) error { return c.Conn.(driver.Pinger).Ping(ctx) }

func (c *mysqlTestConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *mysqlTestConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c *mysqlTestConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

type mysqlTestStmt struct {
	driver.Stmt
	q string
	c *mysqlTestConn
}

func (s *mysqlTestStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (
	driver.Result, error) {
	res, err := s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
	s.c.add(s.q, err)
	return res, err
}

func (s *mysqlTestStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (
	driver.Rows, error) {
	rows, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	s.c.add(s.q, err)
	return rows, err
}

func (s *mysqlTestStmt) CheckNamedValue(nv *driver.NamedValue) error {
	return s.Stmt.(driver.NamedValueChecker).CheckNamedValue(nv)
}
