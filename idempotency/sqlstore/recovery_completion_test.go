//go:build unix

package sqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// executions records the Executed events an Observer sees.
type executions struct {
	mu     sync.Mutex
	events []idempotency.Event
}

func (e *executions) observer() idempotency.Observer {
	return idempotency.Observer{Executed: func(_ context.Context, ev idempotency.Event) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.events = append(e.events, ev)
	}}
}

// only returns the one execution seen.
func (e *executions) only(t *testing.T) idempotency.Event {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	require.Len(t, e.events, 1)
	return e.events[0]
}

// serveGuarded serves h behind the middleware over s, which accepts
// anonymous keys, and reports its executions to ex.
func serveGuarded(t *testing.T, s *sqlstore.Store, ex *executions, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	mw := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithObserver(ex.observer()),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	srv := httptest.NewServer(mw.Wrap(h))
	t.Cleanup(srv.Close)
	return srv
}

// pgPool opens a pool on dsn whose connections are handed out again
// without a ping, however long they sat idle: a broken connection is found
// by the statement that uses it.
func pgPool(t *testing.T, dsn string, maxConns int) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	require.NoError(t, err)
	db := stdlib.OpenDB(*cfg, stdlib.OptionShouldPing(func(context.Context, stdlib.ShouldPingParams) bool {
		return false
	}))
	db.SetMaxOpenConns(maxConns)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func openStore(t *testing.T, db *sql.DB, d sqlstore.Dialect) *sqlstore.Store {
	t.Helper()
	s, err := sqlstore.Open(db, d)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	_, err = db.ExecContext(t.Context(), `CREATE TABLE payments (id TEXT PRIMARY KEY)`)
	require.NoError(t, err)
	return s
}

func countPayments(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM payments`).Scan(&n))
	return n
}

// requireCompletedOnce checks the end of a request whose first answer was
// first: a 201 that is no replay, its execution completed without error,
// its record completed, and a retry that gets the replay without running
// the handler again.
func requireCompletedOnce(t *testing.T, srv *httptest.Server, db *sql.DB, ex *executions, key string,
	first answer, runs *atomic.Int32) {
	t.Helper()
	require.Equal(t, http.StatusCreated, first.status, first.body)
	require.False(t, first.replayed, "the client whose request ran gets its first answer, no replay")
	e := ex.only(t)
	require.Equal(t, idempotency.OutcomeCompleted, e.Outcome, "error: %v", e.Err)
	require.NoError(t, e.Err)
	require.Equal(t, int(idempotency.Completed), readRecord(t, db, key).state)
	again := post(t, srv, "", key, "pay")
	require.Equal(t, http.StatusCreated, again.status, again.body)
	require.True(t, again.replayed)
	require.Equal(t, first.body, again.body)
	require.EqualValues(t, 1, runs.Load(), "the handler ran once")
}

// On PostgreSQL, the connection that will carry the completion of a
// handler that writes nothing through the server's transaction is
// terminated (pg_terminate_backend) between the handler's answer and the
// completion write. The completion, fenced by owner and generation, is
// tried again on a fresh connection: the response is stored, and the
// client's retry gets the replay instead of a second run.
func TestCompletionSurvivesATerminatedConnection(t *testing.T) {
	dsn := pgSchemaDSN(t)
	db := pgPool(t, dsn, 1) // one connection: the handler's query shows which one it is
	s := openStore(t, db, sqlstore.Postgres)
	admin, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	ex := &executions{}
	var runs atomic.Int32
	srv := serveGuarded(t, s, ex, func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		pid := backendPID(t, db)
		var ok bool
		require.NoError(t, admin.QueryRow(`SELECT pg_terminate_backend($1)`, pid).Scan(&ok))
		require.True(t, ok)
		require.Eventually(t, func() bool {
			return count(t, admin, fmt.Sprintf(`SELECT COUNT(*) FROM pg_stat_activity WHERE pid = %d`, pid)) == 0
		}, 10*time.Second, 5*time.Millisecond, "the backend did not exit")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, n)
	})
	first := post(t, srv, "", "k-terminated", "pay")
	requireCompletedOnce(t, srv, admin, ex, "k-terminated", first, &runs)
}

// On PostgreSQL, the completion of a handler that writes nothing through
// the server's transaction commits, and the connection breaks before its
// answer reaches the server process: the completion's outcome is unknown.
// The completion is tried again, finds the record no longer in progress
// (ErrLeaseLost), and reads it: completed by this owner and generation, it
// was this completion. The client gets its first answer, no replay, and
// the execution ended completed.
func TestCompletionWhoseAnswerIsLost(t *testing.T) {
	dsn := withParam(pgSchemaDSN(t), "default_query_exec_mode", "exec") // statements' text on the wire
	cutter, viaProxy := newPGCutter(t, dsn, func(typ byte, body []byte) bool {
		return (typ == 'P' || typ == 'Q') && bytes.Contains(body, []byte("SET state = 2"))
	})
	db := pgPool(t, viaProxy, 4)
	s := openStore(t, db, sqlstore.Postgres)
	ex := &executions{}
	var runs atomic.Int32
	srv := serveGuarded(t, s, ex, func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		cutter.armed.Store(true)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, n)
	})
	first := post(t, srv, "", "k-lost-answer", "pay")
	require.EqualValues(t, 1, cutter.cuts.Load(), "the completion's connection was cut")
	requireCompletedOnce(t, srv, db, ex, "k-lost-answer", first, &runs)
}

// ambiguousCommit is a database whose next COMMIT, once armed, is applied
// while the driver reports an error.
type ambiguousCommit struct {
	name    string
	dialect sqlstore.Dialect
	open    func(t *testing.T) (db *sql.DB, arm func(), hits func() int32)
}

var ambiguousCommits = []ambiguousCommit{
	{name: "sqlite", dialect: sqlstore.SQLite, open: func(t *testing.T) (*sql.DB, func(), func() int32) {
		db, c := openSQLiteCommitFaults(t, sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "idem.db")))
		return db, func() { c.armed.Store(true) }, c.hits.Load
	}},
	{name: "postgres", dialect: sqlstore.Postgres, open: func(t *testing.T) (*sql.DB, func(), func() int32) {
		cutter, viaProxy := newPGCutter(t, pgSchemaDSN(t), func(typ byte, body []byte) bool {
			return typ == 'Q' && bytes.EqualFold(bytes.TrimRight(body, "\x00"), []byte("commit"))
		})
		return pgPool(t, viaProxy, 8), func() { cutter.armed.Store(true) }, cutter.cuts.Load
	}},
}

// A unit's COMMIT reaches the database, which applies it, but the driver
// reports an error (on PostgreSQL the connection is cut right after the
// COMMIT went out; on SQLite the driver is wrapped: see commitFaults).
// Whose commit it was is read from the record, by its owner and
// generation: the request's own. The request's unit (which commits the
// business row with the response) is then completed, and the client gets
// its first answer, no replay; a phase's unit committed, and Phase returns
// its output.
func TestAmbiguousCommitIsResolved(t *testing.T) {
	for _, a := range ambiguousCommits {
		t.Run(a.name, func(t *testing.T) {
			t.Run("request", func(t *testing.T) {
				db, arm, hits := a.open(t)
				s := openStore(t, db, a.dialect)
				ex := &executions{}
				var runs atomic.Int32
				srv := serveGuarded(t, s, ex, func(w http.ResponseWriter, r *http.Request) {
					n := runs.Add(1)
					tx, ok := sqlstore.Tx(r.Context())
					require.True(t, ok)
					_, err := tx.ExecContext(r.Context(), `INSERT INTO payments (id) VALUES ($1)`, fmt.Sprint("pay_", n))
					require.NoError(t, err)
					arm()
					w.WriteHeader(http.StatusCreated)
					fmt.Fprintf(w, `{"payment":%d}`, n)
				})
				first := post(t, srv, "", "k-commit", "pay")
				require.EqualValues(t, 1, hits(), "the COMMIT's answer was lost")
				requireCompletedOnce(t, srv, db, ex, "k-commit", first, &runs)
				require.Equal(t, 1, countPayments(t, db))
			})
			t.Run("phase", func(t *testing.T) {
				db, arm, hits := a.open(t)
				s := openStore(t, db, a.dialect)
				ex := &executions{}
				var runs atomic.Int32
				var phaseErr error
				srv := serveGuarded(t, s, ex, func(w http.ResponseWriter, r *http.Request) {
					n := runs.Add(1)
					run, _ := idempotency.FromContext(r.Context())
					var out []byte
					out, phaseErr = run.Phase(r.Context(), "charge", func(ctx context.Context) ([]byte, error) {
						tx, _ := sqlstore.Tx(ctx)
						_, err := tx.ExecContext(ctx, `INSERT INTO payments (id) VALUES ($1)`, fmt.Sprint("pay_", n))
						arm()
						return fmt.Appendf(nil, "pay_%d", n), err
					})
					if phaseErr != nil {
						http.Error(w, phaseErr.Error(), http.StatusServiceUnavailable)
						return
					}
					w.WriteHeader(http.StatusCreated)
					fmt.Fprintf(w, `{"payment":%q}`, out)
				})
				first := post(t, srv, "", "k-phase", "pay")
				require.EqualValues(t, 1, hits(), "the COMMIT's answer was lost")
				require.NoError(t, phaseErr, "the phase committed")
				requireCompletedOnce(t, srv, db, ex, "k-phase", first, &runs)
				require.Equal(t, 1, countPayments(t, db))
				require.Equal(t, "charge", readRecord(t, db, "k-phase").point)
			})
		})
	}
}
