package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// oneTxServer serves POST /orders guarded by a Middleware over s made
// WithOneTransaction(true) (and opts). The handler inserts the order
// named by its key into onetx_orders through sqlstore.Tx, then calls
// hook (when set) with its transaction, then answers the status in
// ?status= (default 201) with a body naming the run. runs counts the
// handler's executions.
func oneTxServer(t *testing.T, s *sqlstore.Store, db *sql.DB,
	hook func(ctx context.Context, tx *sql.Tx), opts ...idempotency.Option) (
	*httptest.Server, *atomic.Int64) {
	t.Helper()
	_, err := db.Exec(`CREATE TABLE onetx_orders (id VARCHAR(200) PRIMARY KEY)`)
	require.NoError(t, err)
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		key := r.Header.Get("Idempotency-Key")
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO onetx_orders (id) VALUES ($1)`,
			key); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if hook != nil {
			hook(r.Context(), tx)
		}
		status := http.StatusCreated
		if v := r.URL.Query().Get("status"); v != "" {
			_, _ = fmt.Sscan(v, &status)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = fmt.Fprintf(w, `{"order":%q,"run":%d}`, key, n)
	})
	opts = append([]idempotency.Option{idempotency.WithOneTransaction(true),
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }),
		idempotency.WithMonitor("/operations/", []byte(strings.Repeat("s", 32))),
		idempotency.WithLogger(nil)}, opts...)
	mw := idempotency.New(s, opts...)
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &runs
}

type oneTxAnswer struct {
	status   int
	body     string
	header   http.Header
	replayed bool
}

func oneTxPost(t *testing.T, srv *httptest.Server, query, key string) oneTxAnswer {
	t.Helper()
	a, err := oneTxSend(t.Context(), srv.Client(), srv.URL, query, key)
	require.NoError(t, err)
	return a
}

// oneTxSend posts to url's /orders with key, from any goroutine.
func oneTxSend(ctx context.Context, c *http.Client, url, query, key string) (oneTxAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/orders"+query,
		strings.NewReader(`{"amount":100}`))
	if err != nil {
		return oneTxAnswer{}, err
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return oneTxAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return oneTxAnswer{status: resp.StatusCode, body: string(b), header: resp.Header,
		replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}, err
}

// oneTxAsync posts as oneTxSend does on a goroutine of its own; the
// channel gives its answer once, its error failing t on t's goroutine.
func oneTxAsync(t *testing.T, srv *httptest.Server, query, key string) func() oneTxAnswer {
	type result struct {
		a   oneTxAnswer
		err error
	}
	ch := make(chan result, 1)
	go func() {
		a, err := oneTxSend(t.Context(), srv.Client(), srv.URL, query, key)
		ch <- result{a, err}
	}()
	return func() oneTxAnswer {
		r := <-ch
		require.NoError(t, r.err)
		return r.a
	}
}

// oneTxCounts returns how many orders and idempotency records key has.
func oneTxCounts(t *testing.T, db *sql.DB, key string) (orders, records int) {
	t.Helper()
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM onetx_orders WHERE id = $1`, key).
		Scan(&orders))
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM `+sqlstore.DefaultTable+
		` WHERE idem_key = $1`, []byte(key)).Scan(&records))
	return orders, records
}

// A fresh key commits its claim, the handler's write and the response at
// once; a retry replays the response byte for byte without running the
// handler; an answer that is not stored (500) rolls the claim back with
// the handler's write, and the retry runs once.
func TestOneTransactionLifecycle(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		srv, runs := oneTxServer(t, s, db, nil)

		first := oneTxPost(t, srv, "", "k1")
		require.Equal(t, http.StatusCreated, first.status, first.body)
		require.False(t, first.replayed)
		orders, records := oneTxCounts(t, db, "k1")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
		rec, err := s.Get(t.Context(), idempotency.Scope{Principal: "acct_1", Method: "POST",
			Route: "POST /orders", Key: "k1"})
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, rec.State)

		again := oneTxPost(t, srv, "", "k1")
		require.Equal(t, http.StatusCreated, again.status)
		require.True(t, again.replayed)
		require.Equal(t, first.body, again.body)
		require.Equal(t, first.header.Get("Content-Type"), again.header.Get("Content-Type"))
		require.EqualValues(t, 1, runs.Load())

		failed := oneTxPost(t, srv, "?status=500", "k2")
		require.Equal(t, http.StatusInternalServerError, failed.status)
		orders, records = oneTxCounts(t, db, "k2")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records}, "a 500 rolls everything back")
		retry := oneTxPost(t, srv, "", "k2")
		require.Equal(t, http.StatusCreated, retry.status)
		require.False(t, retry.replayed)
		require.EqualValues(t, 3, runs.Load())
		orders, records = oneTxCounts(t, db, "k2")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
	})
}

// Concurrent requests with one key: the first holds the key in its
// transaction; the others wait on the key, then replay its response. One
// order, one execution.
func TestOneTransactionConcurrentDuplicates(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		hold := func(context.Context, *sql.Tx) { time.Sleep(100 * time.Millisecond) }
		srv, runs := oneTxServer(t, s, db, hold, idempotency.WithMaxInProgressWait(30*time.Second))
		const n = 8
		waits := make([]func() oneTxAnswer, n)
		for i := range n {
			waits[i] = oneTxAsync(t, srv, "", "dup")
		}
		answers := make([]oneTxAnswer, n)
		for i, w := range waits {
			answers[i] = w()
		}
		var fresh, replays int
		for _, a := range answers {
			require.Equal(t, http.StatusCreated, a.status, a.body)
			require.Equal(t, answers[0].body, a.body)
			if a.replayed {
				replays++
			} else {
				fresh++
			}
		}
		require.Equal(t, [2]int{1, n - 1}, [2]int{fresh, replays})
		require.EqualValues(t, 1, runs.Load())
		orders, records := oneTxCounts(t, db, "dup")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
	})
}

// A request whose key another transaction holds past WithMaxInProgressWait
// gets the in-progress 409 (without a monitor Location: nothing of the
// record can be read), and a call of Do an *InProgressError; once the
// holder commits, both replay. SQLite waits for its write lock instead
// (the busy timeout), which this does not test.
func TestOneTransactionBoundedWait(t *testing.T) {
	// Not on SQLite: it bounds the wait by its busy timeout, not by
	// WithMaxInProgressWait.
	forEachServer(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		entered, release := make(chan struct{}), make(chan struct{})
		hold := func(context.Context, *sql.Tx) { close(entered); <-release }
		wait := 300 * time.Millisecond // the stores wait 1 s at least
		srv, runs := oneTxServer(t, s, db, hold, idempotency.WithMaxInProgressWait(wait))
		done := oneTxAsync(t, srv, "", "held")
		<-entered

		start := time.Now()
		busy := oneTxPost(t, srv, "", "held")
		require.Equal(t, http.StatusConflict, busy.status, busy.body)
		require.Contains(t, busy.body, string(idempotency.CodeInProgress))
		require.Empty(t, busy.header.Get("Location"))
		require.GreaterOrEqual(t, time.Since(start), wait, "it waited on the key first")

		mw := idempotency.New(s, idempotency.WithOneTransaction(true),
			idempotency.WithMaxInProgressWait(wait), idempotency.WithLogger(nil))
		call := idempotency.Call{Principal: "acct_1", Operation: "op", Key: "held-do"}
		doEntered, doRelease := make(chan struct{}), make(chan struct{})
		doDone := make(chan error)
		go func() {
			_, err := mw.Do(t.Context(), call, func(ctx context.Context, _ *idempotency.Run) (
				[]byte, error) {
				close(doEntered)
				<-doRelease
				return []byte("out"), nil
			})
			doDone <- err
		}()
		<-doEntered
		_, err := mw.Do(t.Context(), call, func(context.Context, *idempotency.Run) ([]byte, error) {
			return nil, errors.New("must not run")
		})
		var ipe *idempotency.InProgressError
		require.ErrorAs(t, err, &ipe)
		require.Equal(t, time.Second, ipe.RetryAfter.Round(100*time.Millisecond))
		close(doRelease)
		require.NoError(t, <-doDone)
		res, err := mw.Do(t.Context(), call, func(context.Context, *idempotency.Run) ([]byte, error) {
			return nil, errors.New("must not run")
		})
		require.NoError(t, err)
		require.Equal(t, idempotency.Result{Output: []byte("out"), Replayed: true}, res)

		close(release)
		first := done()
		require.Equal(t, http.StatusCreated, first.status)
		after := oneTxPost(t, srv, "", "held")
		require.True(t, after.replayed)
		require.Equal(t, first.body, after.body)
		require.EqualValues(t, 1, runs.Load())
	})
}

// killOwnConnection ends, server side, the connection that runs tx: the
// crash of the transaction's connection in the middle of a handler.
func killOwnConnection(ctx context.Context, b backend, db *sql.DB, tx *sql.Tx) error {
	var id int64
	switch b.dialect {
	case sqlstore.Postgres:
		if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&id); err != nil {
			return err
		}
		var ok bool
		if err := db.QueryRowContext(ctx, `SELECT pg_terminate_backend($1)`, id).Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("backend %d not terminated", id)
		}
	case sqlstore.MySQL:
		if err := tx.QueryRowContext(ctx, `SELECT CONNECTION_ID()`).Scan(&id); err != nil {
			return err
		}
		_, err := db.ExecContext(ctx, fmt.Sprintf("KILL %d", id))
		return err
	}
	return nil
}

// The connection of a one-transaction request dies after the handler's
// write and before the completion: the request answers 503, and neither
// the order nor the claim is left (nothing to resume); the retry runs
// once.
func TestOneTransactionCrash(t *testing.T) {
	// Not on SQLite: an embedded database has no connection of its own to kill.
	forEachServer(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		var kill atomic.Bool
		kill.Store(true)
		killed := make(chan error, 1)
		hook := func(ctx context.Context, tx *sql.Tx) {
			if kill.CompareAndSwap(true, false) {
				killed <- killOwnConnection(ctx, b, db, tx)
			}
		}
		srv, runs := oneTxServer(t, s, db, hook)
		crashed := oneTxPost(t, srv, "", "crash")
		require.NoError(t, <-killed)
		require.Equal(t, http.StatusServiceUnavailable, crashed.status, crashed.body)
		orders, records := oneTxCounts(t, db, "crash")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records}, "the order and the claim vanish")

		retry := oneTxPost(t, srv, "", "crash")
		require.Equal(t, http.StatusCreated, retry.status, retry.body)
		require.False(t, retry.replayed)
		require.EqualValues(t, 2, runs.Load())
		orders, records = oneTxCounts(t, db, "crash")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
	})
}

// The function door: fn's write and its output commit with the claim; an
// error of fn and a panic roll everything back, and the next call runs
// once; concurrent calls make one order; Phase and External fail with
// ErrOneTransaction.
func TestOneTransactionDo(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		_, err := db.Exec(`CREATE TABLE onetx_orders (id VARCHAR(200) PRIMARY KEY)`)
		require.NoError(t, err)
		mw := idempotency.New(s, idempotency.WithOneTransaction(true),
			idempotency.WithMaxInProgressWait(30*time.Second), idempotency.WithLogger(nil))
		var runs atomic.Int64
		fail := errors.New("declined for now")
		do := func(key string, mode string) (idempotency.Result, error) {
			return mw.Do(t.Context(), idempotency.Call{Principal: "acct_1", Operation: "order",
				Key: key}, func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
				n := runs.Add(1)
				tx, ok := sqlstore.Tx(ctx)
				if !ok {
					return nil, errors.New("no transaction")
				}
				if _, err := tx.ExecContext(ctx, `INSERT INTO onetx_orders (id) VALUES ($1)`,
					key); err != nil {
					return nil, err
				}
				switch mode {
				case "fail":
					return nil, fail
				case "panic":
					panic("boom")
				case "hold":
					time.Sleep(100 * time.Millisecond)
				}
				return fmt.Appendf(nil, "order %s run %d", key, n), nil
			})
		}
		res, err := do("d1", "")
		require.NoError(t, err)
		require.Equal(t, "order d1 run 1", string(res.Output))
		again, err := do("d1", "")
		require.NoError(t, err)
		require.Equal(t, idempotency.Result{Output: res.Output, Replayed: true}, again)

		_, err = do("d2", "fail")
		require.ErrorIs(t, err, fail)
		_, err = do("d2", "panic")
		var pe *idempotency.PanicError
		require.ErrorAs(t, err, &pe)
		orders, records := oneTxCounts(t, db, "d2")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records})
		_, err = do("d2", "")
		require.NoError(t, err)
		require.EqualValues(t, 4, runs.Load())

		var wg sync.WaitGroup
		var fresh atomic.Int64
		errs := make([]error, 6)
		for i := range errs {
			wg.Go(func() {
				var res idempotency.Result
				res, errs[i] = do("d3", "hold")
				if errs[i] == nil && !res.Replayed {
					fresh.Add(1)
				}
			})
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		require.EqualValues(t, 1, fresh.Load())
		orders, records = oneTxCounts(t, db, "d3")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})

		_, err = mw.Do(t.Context(), idempotency.Call{Principal: "acct_1", Operation: "order",
			Key: "d4"}, func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
			_, perr := run.Phase(ctx, "charge", func(context.Context) ([]byte, error) {
				return nil, nil
			})
			require.ErrorIs(t, perr, idempotency.ErrOneTransaction)
			require.ErrorIs(t, perr, idempotency.ErrMisuse)
			_, xerr := run.External(ctx, "psp",
				func(context.Context, string) ([]byte, error) { return nil, nil },
				func(context.Context, string) ([]byte, bool, error) { return nil, false, nil })
			require.ErrorIs(t, xerr, idempotency.ErrOneTransaction)
			return nil, errors.Join(perr, xerr)
		})
		require.ErrorIs(t, err, idempotency.ErrOneTransaction)
		_, records = oneTxCounts(t, db, "d4")
		require.Zero(t, records)
	})
}

// The bound on the claim's lock wait is the claim's alone: the handler's
// statements in the transaction wait on locks as the session's setting
// says.
func TestOneTransactionHandlerLockWait(t *testing.T) {
	// Not on SQLite: it has no lock wait per statement.
	forEachServer(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		read := `SELECT current_setting('lock_timeout')`
		if b.dialect == sqlstore.MySQL {
			read = `SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS CHAR)`
		}
		var session string
		require.NoError(t, db.QueryRow(read).Scan(&session))
		var inHandler string
		var readErr error
		hook := func(ctx context.Context, tx *sql.Tx) {
			readErr = tx.QueryRowContext(ctx, read).Scan(&inHandler)
		}
		srv, _ := oneTxServer(t, s, db, hook, idempotency.WithMaxInProgressWait(0))
		require.Equal(t, http.StatusCreated, oneTxPost(t, srv, "", "lw").status)
		require.NoError(t, readErr) // written before the answer the post waited for
		require.Equal(t, session, inHandler)
		var after string
		for range 20 { // every connection of the pool, the claim's included
			require.NoError(t, db.QueryRow(read).Scan(&after))
			require.Equal(t, session, after)
		}
	})
}

// The statements of a one-transaction request, as the store's driver
// sends them: a fresh key is BEGIN, the claim, the handler's INSERT, the
// completion and COMMIT, one commit (MySQL adds the two statements that
// bound the claim's lock wait and restore it); a replay is BEGIN, the
// claim that inserts nothing, the read and ROLLBACK, no commit.
func TestOneTransactionStatements(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		db, log := openCounted(t, b)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(t.Context()))
		srv, _ := oneTxServer(t, s, db, nil)
		words := func(m int) string {
			var got []string
			for _, st := range log.since(m) {
				got = append(got, strings.ToUpper(verb(st)))
			}
			return strings.Join(got, " ")
		}
		fresh, replay := "BEGIN INSERT INSERT UPDATE COMMIT", "BEGIN INSERT SELECT ROLLBACK"
		if b.dialect == sqlstore.MySQL {
			fresh, replay = "BEGIN SET INSERT SET INSERT UPDATE COMMIT",
				"BEGIN SET INSERT SET SELECT ROLLBACK"
		}
		m := log.mark()
		require.Equal(t, http.StatusCreated, oneTxPost(t, srv, "", "s1").status)
		require.Equal(t, fresh, words(m), "%q", brief(log.since(m)))
		m = log.mark()
		require.True(t, oneTxPost(t, srv, "", "s1").replayed)
		require.Equal(t, replay, words(m), "%q", brief(log.since(m)))
	})
}

// The concurrency gate on one-transaction routes: 4 servers, each with a
// pool of its own on one database, take 160 concurrent requests with one
// key, the default in-progress wait (none: the stores' floor of 1 s
// applies) and a handler that holds its transaction 300 ms and makes a
// side effect outside it. Exactly one execution and one business row;
// every other answer is a replay identical to the one success, or the
// in-progress conflict; a later retry on any server replays it.
func TestOneTransactionGate(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		const servers, requests = 4, 160
		var open func() *sql.DB
		switch b.dialect {
		case sqlstore.Postgres:
			dsn := pgSchemaDSN(t)
			open = func() *sql.DB {
				db, err := sql.Open("pgx", dsn)
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
		case sqlstore.MySQL:
			cfg := mysqlDatabaseConfig(t)
			open = func() *sql.DB { return openMySQLConfig(t, cfg, nil) }
		default:
			path := sqlstore.SQLiteDSN(t.TempDir() + "/gate.db")
			open = func() *sql.DB {
				db, err := sql.Open("sqlite", path)
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
		}
		var executions atomic.Int64
		var urls []string
		var first *sql.DB
		for i := range servers {
			db := open()
			db.SetMaxOpenConns(8)
			s, err := sqlstore.Open(db, b.dialect)
			require.NoError(t, err)
			if i == 0 {
				first = db
				require.NoError(t, s.Migrate(t.Context()))
				_, err = db.Exec(`CREATE TABLE onetx_orders (id VARCHAR(200) PRIMARY KEY)`)
				require.NoError(t, err)
			}
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := executions.Add(1) // the side effect outside the transaction
				tx, ok := sqlstore.Tx(r.Context())
				if !ok {
					http.Error(w, "no transaction", http.StatusInternalServerError)
					return
				}
				if _, err := tx.ExecContext(r.Context(),
					`INSERT INTO onetx_orders (id) VALUES ($1)`, fmt.Sprint("order-", n)); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				time.Sleep(300 * time.Millisecond)
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, `{"order":%d,"server":%d}`, n, i)
			})
			mw := idempotency.New(s, idempotency.WithOneTransaction(true), idempotency.WithLogger(nil),
				idempotency.WithPrincipal(func(*http.Request) (string, error) { return "gate", nil }))
			srv := httptest.NewServer(mw.Wrap(h))
			t.Cleanup(srv.Close)
			urls = append(urls, srv.URL)
		}
		client := &http.Client{Timeout: 60 * time.Second,
			Transport: &http.Transport{MaxIdleConnsPerHost: requests}}
		t.Cleanup(client.CloseIdleConnections)
		results := make([]oneTxAnswer, requests)
		errs := make([]error, requests)
		var wg sync.WaitGroup
		for i := range requests {
			wg.Go(func() {
				results[i], errs[i] = oneTxSend(t.Context(), client, urls[i%servers], "", "gate-key")
			})
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		var originals, replays, conflicts int
		success := ""
		for i, r := range results {
			switch {
			case r.status == http.StatusCreated && !r.replayed:
				originals++
				success = r.body
			case r.status == http.StatusCreated:
				replays++
			case r.status == http.StatusConflict &&
				strings.Contains(r.body, string(idempotency.CodeInProgress)):
				conflicts++
			default:
				t.Fatalf("request %d: %d %q", i, r.status, r.body)
			}
		}
		require.Equal(t, 1, originals)
		require.EqualValues(t, 1, executions.Load())
		for _, r := range results {
			if r.replayed {
				require.Equal(t, success, r.body)
			}
		}
		var rows int
		require.NoError(t, first.QueryRow(`SELECT COUNT(*) FROM onetx_orders`).Scan(&rows))
		require.Equal(t, 1, rows)
		t.Logf("%d requests over %d servers: 1 original, %d replays, %d in-progress conflicts",
			requests, servers, replays, conflicts)
		for _, u := range urls {
			a, err := oneTxSend(t.Context(), client, u, "", "gate-key")
			require.NoError(t, err)
			require.Equal(t, [2]any{http.StatusCreated, true}, [2]any{a.status, a.replayed})
			require.Equal(t, success, a.body)
		}
	})
}

// A shutdown cancels a one-transaction handler in the middle: its answer
// (503) is not stored, its write rolls back with the claim, and the retry,
// on a server that is up, runs once.
func TestOneTransactionShutdownMidHandler(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		shutdown, stop := context.WithCancel(t.Context())
		entered := make(chan struct{})
		var once sync.Once
		hook := func(ctx context.Context, tx *sql.Tx) {
			once.Do(func() {
				close(entered)
				<-ctx.Done() // the shutdown
			})
		}
		srv, runs := oneTxServer(t, s, db, hook, idempotency.WithShutdown(shutdown))
		// After the hook the handler answers 503, as one stopped by a shutdown does.
		done := oneTxAsync(t, srv, "?status=503", "sd")
		<-entered
		orders, records := oneTxCounts(t, db, "sd")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records}, "nothing is visible before the commit")
		stop()
		require.Equal(t, http.StatusServiceUnavailable, done().status)
		orders, records = oneTxCounts(t, db, "sd")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records})

		up, upRuns := oneTxServer2(t, s)
		retry := oneTxPost(t, up, "", "sd")
		require.Equal(t, http.StatusCreated, retry.status, retry.body)
		require.EqualValues(t, 1, runs.Load())
		require.EqualValues(t, 1, upRuns.Load())
		orders, records = oneTxCounts(t, db, "sd")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
		require.Zero(t, db.Stats().InUse, "no connection is held")
	})
}

// oneTxServer2 is oneTxServer's handler on the existing onetx_orders
// table, without hook and options.
func oneTxServer2(t *testing.T, s *sqlstore.Store) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO onetx_orders (id) VALUES ($1)`,
			r.Header.Get("Idempotency-Key")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw := idempotency.New(s, idempotency.WithOneTransaction(true), idempotency.WithLogger(nil),
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &runs
}
