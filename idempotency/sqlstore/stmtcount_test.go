package sqlstore_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// stmtLog records every statement a database handle sends: each Exec and
// Query, and BEGIN, COMMIT and ROLLBACK, which cost a round trip as well.
// With a hook set (afterNext), it also runs code of the test's own right
// after a statement has run.
type stmtLog struct {
	mu    sync.Mutex
	stmts []string
	after func() // run once after the next statement (a query's once its rows are closed)
}

// afterNext makes f run once, on the goroutine that sent it, right after
// the next statement any connection of the handle runs: between two
// statements of one Store call, where another client's write can land.
// f's own statements do not trigger it again.
func (l *stmtLog) afterNext(f func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.after = f
}

// ran is called by the connections after each statement.
func (l *stmtLog) ran() {
	l.mu.Lock()
	f := l.after
	l.after = nil
	l.mu.Unlock()
	if f != nil {
		f()
	}
}

func (l *stmtLog) add(q string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stmts = append(l.stmts, strings.Join(strings.Fields(q), " "))
}

func (l *stmtLog) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.stmts)
}

// since returns the statements sent after mark m.
func (l *stmtLog) since(m int) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.stmts[m:]...)
}

// pgTracer counts the statements of a pgx connection (pgx traces BEGIN and
// COMMIT as the statements they are). pgx ends a query's trace when its
// rows are closed.
type pgTracer struct{ log *stmtLog }

func (p pgTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	p.log.add(d.SQL)
	return ctx
}

func (p pgTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) { p.log.ran() }

// openCounted opens a fresh database of b's dialect whose statements are
// recorded: on PostgreSQL through a pgx QueryTracer (pgx.ParseConfig, the
// tracer, stdlib.OpenDB), on SQLite through a driver.Connector that wraps
// modernc.org/sqlite's connections.
func openCounted(t *testing.T, b backend) (*sql.DB, *stmtLog) {
	t.Helper()
	log := &stmtLog{}
	if b.dialect == sqlstore.MySQL {
		return openMySQLConfig(t, mysqlDatabaseConfig(t), log), log
	}
	var db *sql.DB
	if b.dialect == sqlstore.Postgres {
		cfg, err := pgx.ParseConfig(pgSchemaDSN(t))
		require.NoError(t, err)
		cfg.Tracer = pgTracer{log}
		db = stdlib.OpenDB(*cfg)
	} else {
		db = sql.OpenDB(countingConnector{dsn: sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "idem.db")), log: log})
	}
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return db, log
}

// countingConnector opens modernc.org/sqlite connections that record their
// statements.
type countingConnector struct {
	dsn string
	log *stmtLog
}

func (c countingConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := (&sqlite.Driver{}).Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return countingConn{conn: conn, log: c.log}, nil
}

func (countingConnector) Driver() driver.Driver { return &sqlite.Driver{} }

type countingConn struct {
	conn driver.Conn
	log  *stmtLog
}

// Prepare prepares q; SQLite prepares in the process, so only the
// prepared statement's executions count.
func (c countingConn) Prepare(q string) (driver.Stmt, error) {
	st, err := c.conn.Prepare(q)
	if err != nil {
		return nil, err
	}
	return countingStmt{Stmt: st, q: q, log: c.log}, nil
}

type countingStmt struct {
	driver.Stmt
	q   string
	log *stmtLog
}

func (s countingStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.log.add(s.q)
	defer s.log.ran()
	return s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s countingStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.log.add(s.q)
	rows, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err != nil {
		s.log.ran()
		return nil, err
	}
	return countingRows{Rows: rows, log: s.log}, nil
}

// countingRows reports its statement as run when it is closed: SQLite
// holds a writing statement's lock until then.
type countingRows struct {
	driver.Rows
	log *stmtLog
}

func (r countingRows) Close() error {
	err := r.Rows.Close()
	r.log.ran()
	return err
}

func (c countingConn) Close() error { return c.conn.Close() }

func (c countingConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.log.add("BEGIN")
	tx, err := c.conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return countingTx{tx: tx, log: c.log}, nil
}

func (c countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.log.add(q)
	defer c.log.ran()
	return c.conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.log.add(q)
	rows, err := c.conn.(driver.QueryerContext).QueryContext(ctx, q, args)
	if err != nil {
		c.log.ran()
		return nil, err
	}
	return countingRows{Rows: rows, log: c.log}, nil
}

func (c countingConn) ResetSession(ctx context.Context) error {
	return c.conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c countingConn) IsValid() bool { return c.conn.(driver.Validator).IsValid() }

type countingTx struct {
	tx  driver.Tx
	log *stmtLog
}

func (t countingTx) Commit() error {
	t.log.add("COMMIT")
	defer t.log.ran()
	return t.tx.Commit()
}

func (t countingTx) Rollback() error {
	t.log.add("ROLLBACK")
	return t.tx.Rollback()
}

// losingClaim checks the statements of a claim that changed nothing, on
// every dialect two: the INSERT, which finds the key and does nothing (on
// MySQL fails on the duplicate key), and the read of the record to answer
// from.
func losingClaim(t *testing.T, stmts []string, what string) {
	t.Helper()
	require.Len(t, stmts, 2, "%s: %q", what, brief(stmts))
	require.Equal(t, "INSERT", verb(stmts[0]), "%s: %q", what, brief(stmts))
	require.Equal(t, "SELECT", verb(stmts[1]), "%s: %q", what, brief(stmts))
}

// TestStatementsPerStoreCall counts the statements of the Store's calls on
// a request's path: a claim that creates its record is one statement, one
// that finds a completed record or one in progress two (see losingClaim); a
// completion outside a unit is one conditional UPDATE in autocommit (no
// BEGIN or COMMIT); a takeover and a restart past the window are counted
// per dialect.
func TestStatementsPerStoreCall(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		db, log := openCounted(t, b)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(t.Context()))
		ctx := t.Context()

		m := log.mark()
		rec, won, err := claimed(s.Claim(ctx, claimAt(scope("fresh"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		require.Len(t, log.since(m), 1, "fresh claim: %q", log.since(m))

		m = log.mark()
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201, Body: []byte("ok")}, t0))
		require.Len(t, log.since(m), 1, "completion outside a unit: %q", log.since(m))

		m = log.mark()
		got, won, err := claimed(s.Claim(ctx, claimAt(scope("fresh"), "B", "fp", t0)))
		require.NoError(t, err)
		require.False(t, won)
		require.Equal(t, idempotency.Completed, got.State)
		require.Equal(t, []byte("ok"), got.Response.Body)
		losingClaim(t, log.since(m), "claim of a completed record")

		_, _, err = claimed(s.Claim(ctx, claimAt(scope("busy"), "A", "fp", t0)))
		require.NoError(t, err)
		m = log.mark()
		got, won, err = claimed(s.Claim(ctx, claimAt(scope("busy"), "B", "fp", t0)))
		require.NoError(t, err)
		require.False(t, won)
		require.Equal(t, idempotency.InProgress, got.State)
		require.Equal(t, "A", got.Owner)
		losingClaim(t, log.since(m), "claim of an in-progress record")

		// A claim that wins an existing record: the INSERT, the read,
		// and on PostgreSQL and SQLite a conditional UPDATE, on MySQL a
		// locking transaction.
		later := t0.Add(2 * time.Hour) // past the leases and the 1 h window
		for _, tc := range []struct {
			key     string
			outcome idempotency.ClaimOutcome
		}{
			{"busy", idempotency.ClaimTakenOver},
			{"fresh", idempotency.ClaimCreated},
		} {
			m = log.mark()
			res, err := s.Claim(ctx, claimAt(scope(tc.key), "C", "fp", later))
			require.NoError(t, err)
			require.Equal(t, tc.outcome, res.Outcome, tc.key)
			want := "INSERT SELECT UPDATE"
			if b.dialect == sqlstore.MySQL {
				want = "INSERT SELECT BEGIN SELECT UPDATE COMMIT"
			}
			var got []string
			for _, st := range log.since(m) {
				got = append(got, verb(st))
			}
			require.Equal(t, want, strings.Join(got, " "), "%s: %q", tc.key, brief(log.since(m)))
		}
	})
}

// TestStatementsPerRequest counts what the middleware sends to each SQL
// store per guarded request: a fresh key whose handler writes nothing is
// two statements (claim and completion); one whose handler writes through
// Tx adds BEGIN and COMMIT around its own statements and the completion; a
// phase adds its recovery point, one statement when its function writes
// nothing through Tx, in the phase's BEGIN and COMMIT when it does; a
// replay and an in-progress 409 are two statements each (see losingClaim).
func TestStatementsPerRequest(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		db, log := openCounted(t, b)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(t.Context()))

		_, err = db.Exec(`CREATE TABLE notes (id TEXT)`)
		require.NoError(t, err)
		note := func(ctx context.Context) error {
			tx, ok := sqlstore.Tx(ctx)
			if !ok {
				return errors.New("no transaction")
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO notes (id) VALUES ('n')`)
			return err
		}
		entered, release := make(chan struct{}, 1), make(chan struct{})
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			q := r.URL.Query()
			if q.Has("block") {
				entered <- struct{}{}
				<-release
			}
			if q.Has("phase") {
				run, _ := idempotency.FromContext(r.Context())
				if _, err := run.Phase(r.Context(), "p", func(ctx context.Context) ([]byte, error) {
					if q.Get("phase") == "tx" {
						return nil, note(ctx)
					}
					return nil, nil
				}); err != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
			}
			if q.Has("tx") && note(r.Context()) != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, `{"id":"pay_1"}`)
		})
		mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
		srv := httptest.NewServer(mw.Wrap(h))
		t.Cleanup(srv.Close)
		send := func(query, key string) int {
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/pay"+query, strings.NewReader(`{"a":1}`))
			require.NoError(t, err)
			req.Header.Set("Idempotency-Key", key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return resp.StatusCode
		}

		m := log.mark()
		require.Equal(t, http.StatusCreated, send("", "k1"))
		fresh := log.since(m)

		m = log.mark()
		require.Equal(t, http.StatusCreated, send("", "k1"))
		losingClaim(t, log.since(m), "replay")

		done := make(chan int)
		go func() { done <- send("?block", "k2") }()
		<-entered
		m = log.mark()
		require.Equal(t, http.StatusConflict, send("?block", "k2"))
		losingClaim(t, log.since(m), "in-progress 409")
		close(release)
		require.Equal(t, http.StatusCreated, <-done)

		// A handler that never asked for its unit: the claim, then one
		// fenced UPDATE in autocommit (no BEGIN, no COMMIT).
		require.Len(t, fresh, 2, "fresh key, handler writes nothing: %q", brief(fresh))
		require.Equal(t, "UPDATE", verb(fresh[1]), "fresh key: %q", brief(fresh))

		for _, tc := range []struct{ query, want string }{
			{"?tx", "claim BEGIN INSERT UPDATE COMMIT"},
			{"?phase", "claim UPDATE UPDATE"},
			{"?phase=tx", "claim BEGIN INSERT UPDATE COMMIT UPDATE"},
			{"?phase=tx&tx", "claim BEGIN INSERT UPDATE COMMIT BEGIN INSERT UPDATE COMMIT"},
		} {
			m = log.mark()
			require.Equal(t, http.StatusCreated, send(tc.query, "k"+tc.query))
			var got []string
			for i, st := range log.since(m) {
				if i == 0 {
					got = append(got, "claim")
					continue
				}
				got = append(got, strings.ToUpper(verb(st)))
			}
			require.Equal(t, tc.want, strings.Join(got, " "), "%s: %q", tc.query, brief(log.since(m)))
		}
	})
}

// verb is the first word of a statement.
func verb(stmt string) string { return strings.Fields(stmt)[0] }

// brief shortens each statement to its first words, for messages.
func brief(stmts []string) []string {
	out := make([]string, len(stmts))
	for i, s := range stmts {
		if f := strings.Fields(s); len(f) > 3 {
			s = strings.Join(f[:3], " ") + " ..."
		}
		out[i] = s
	}
	return out
}
