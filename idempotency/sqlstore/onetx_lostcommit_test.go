//go:build unix

package sqlstore_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A request on a route that commits in one transaction: its COMMIT (of the
// claim, the handler's write and the response at once) reaches the
// database, which applies it, and its answer is lost (PostgreSQL: the
// connection is cut once the server answered it; MySQL: the driver's
// connection is closed after it; SQLite: the driver is wrapped). The
// record, read back by its owner and generation, says the commit applied:
// the client gets its first answer, no replay, and the retry replays it
// without running the handler again; one payment.
func TestOneTransactionCommitWhoseAnswerIsLost(t *testing.T) {
	commits := append([]ambiguousCommit{}, ambiguousCommits...)
	commits = append(commits, ambiguousCommit{name: "mysql", dialect: sqlstore.MySQL,
		open: func(t *testing.T) (*sql.DB, func(), func() int32) {
			c, err := mysql.NewConnector(mysqlDatabaseConfig(t))
			require.NoError(t, err)
			lc := &lostCommits{Connector: mysqlTestConnector{Connector: c}}
			db := sql.OpenDB(lc)
			db.SetMaxOpenConns(8)
			t.Cleanup(func() { _ = db.Close() })
			require.NoError(t, db.Ping())
			return db, func() { lc.armed.Store(true) }, lc.hits.Load
		}})
	for _, a := range commits {
		t.Run(a.name, func(t *testing.T) {
			db, arm, hits := a.open(t)
			s, err := sqlstore.Open(db, a.dialect)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			_, err = db.ExecContext(t.Context(), `CREATE TABLE payments (id VARCHAR(64) PRIMARY KEY)`)
			require.NoError(t, err)
			ex := &executions{}
			var runs atomic.Int32
			mw := idempotency.New(s, idempotency.WithOneTransaction(true),
				idempotency.WithAnonymousKeys(true), idempotency.WithObserver(ex.observer()),
				idempotency.WithLogger(slog.New(slog.DiscardHandler)))
			srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
				r *http.Request) {
				n := runs.Add(1)
				tx, ok := sqlstore.Tx(r.Context())
				if !ok {
					http.Error(w, "no transaction", http.StatusInternalServerError)
					return
				}
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO payments (id) VALUES ($1)`,
					fmt.Sprint("pay_", n)); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				arm()
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"payment":%d}`, n)
			})))
			t.Cleanup(srv.Close)

			first := post(t, srv, "", "k-onetx-commit", "pay")
			require.EqualValues(t, 1, hits(), "the COMMIT's answer was lost")
			requireCompletedOnce(t, srv, db, ex, "k-onetx-commit", first, &runs)
			require.Equal(t, 1, countPayments(t, db))
			require.Zero(t, db.Stats().InUse)
		})
	}
}

// lostCommits wraps a connector: once armed, the next transaction's Commit
// commits, then the driver's connection is closed and Commit reports the
// loss, as a driver does when the answer to a COMMIT the database applied
// never arrives.
type lostCommits struct {
	driver.Connector
	armed atomic.Bool
	hits  atomic.Int32
}

var errLostCommit = errors.New("the connection died after COMMIT (injected)")

func (c *lostCommits) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &lostCommitConn{Conn: conn, c: c}, nil
}

type lostCommitConn struct {
	driver.Conn
	c    *lostCommits
	dead atomic.Bool
}

func (f *lostCommitConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := f.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &lostCommitTx{Tx: tx, conn: f}, nil
}

func (f *lostCommitConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	return f.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
}

func (f *lostCommitConn) ExecContext(ctx context.Context, q string,
	args []driver.NamedValue) (driver.Result, error) {
	return f.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (f *lostCommitConn) QueryContext(ctx context.Context, q string,
	args []driver.NamedValue) (driver.Rows, error) {
	return f.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (f *lostCommitConn) CheckNamedValue(nv *driver.NamedValue) error {
	return f.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

func (f *lostCommitConn) Ping(ctx context.Context) error {
	return f.Conn.(driver.Pinger).Ping(ctx)
}

func (f *lostCommitConn) ResetSession(ctx context.Context) error {
	if f.dead.Load() {
		return driver.ErrBadConn
	}
	return f.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (f *lostCommitConn) IsValid() bool {
	return !f.dead.Load() && f.Conn.(driver.Validator).IsValid()
}

type lostCommitTx struct {
	driver.Tx
	conn *lostCommitConn
}

func (t *lostCommitTx) Commit() error {
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	if t.conn.c.armed.CompareAndSwap(true, false) {
		t.conn.c.hits.Add(1)
		t.conn.dead.Store(true)
		_ = t.conn.Conn.Close()
		return errLostCommit
	}
	return nil
}
