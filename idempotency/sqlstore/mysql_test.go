package sqlstore_test

import (
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
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

// createOrdersMySQL is createOrders on MySQL, which has no deferred
// constraint: the orders table takes any customer, and the test pool's
// connections check at each COMMIT that every order's customer exists,
// killing their own session when one does not (see mysqlCommitCheck), so
// that the COMMIT really fails and the server rolls the transaction back.
func createOrdersMySQL(t testing.TB, db *sql.DB) {
	t.Helper()
	for _, s := range []string{
		`CREATE TABLE customers (id VARCHAR(255) PRIMARY KEY)`,
		`INSERT INTO customers (id) VALUES ('cus_1')`,
		`CREATE TABLE orders (id VARCHAR(255) PRIMARY KEY, amount INTEGER NOT NULL, customer TEXT NOT NULL)`,
	} {
		_, err := db.Exec(s)
		require.NoError(t, err, s)
	}
	checkAtCommit(t, db, `SELECT COUNT(*) FROM orders o LEFT JOIN customers c ON c.id = o.customer WHERE c.id IS NULL`)
}

// mysqlBackend is the MySQL entry of backends.
func mysqlBackend(t testing.TB) backend {
	t.Helper()
	for _, b := range backends {
		if b.dialect == sqlstore.MySQL {
			return b
		}
	}
	t.Fatal("no MySQL backend")
	return backend{}
}

// waitLockWaits waits until n transactions of db's database wait for a
// lock. It polls every 150 ms: InnoDB refreshes its INNODB_TRX cache only
// when no one read it for 100 ms.
func waitLockWaits(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM information_schema.INNODB_TRX t
			JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
			WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()`).Scan(&waiting))
		if waiting >= n {
			return
		}
		if time.Now().After(deadline) {
			rows, err := db.Query(`SELECT p.ID, p.DB, p.COMMAND, p.STATE, p.INFO, COALESCE(t.trx_state, '') FROM information_schema.PROCESSLIST p
				LEFT JOIN information_schema.INNODB_TRX t ON p.ID = t.trx_mysql_thread_id WHERE p.DB = DATABASE()`)
			require.NoError(t, err)
			for rows.Next() {
				var id int64
				var db, cmd, state, info, trx sql.NullString
				require.NoError(t, rows.Scan(&id, &db, &cmd, &state, &info, &trx))
				t.Logf("session %d: %s %s %q %q trx %s", id, db.String, cmd.String, state.String, info.String, trx.String)
			}
			rows.Close()
			t.Fatalf("%d of %d transactions wait for a lock", waiting, n)
		}
		time.Sleep(150 * time.Millisecond)
	}
}

// Two claims of one key that both wait behind the DELETE of its record (a
// release, here held open in a transaction) meet InnoDB's classic
// deadlock when it commits: both checked the key for duplicates under a
// shared lock, both find it gone and both insert. InnoDB rolls one back
// (1213); the Store runs that claim again, and it finds the other's fresh
// record: one winner, one ClaimExisting naming it, no error.
func TestMySQLClaimsBehindAReleaseDeadlockAndRetry(t *testing.T) {
	s, db := newStore(t, mysqlBackend(t))
	ctx := t.Context()
	_, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	var hash []byte
	require.NoError(t, db.QueryRow(`SELECT scope_hash FROM `+sqlstore.DefaultTable+` WHERE idem_key = $1`, []byte("k")).Scan(&hash))

	release, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = release.Rollback() }()
	_, err = release.Exec(`DELETE FROM `+sqlstore.DefaultTable+` WHERE scope_hash = $1`, hash)
	require.NoError(t, err)

	type result struct {
		res idempotency.ClaimResult
		err error
	}
	results := make(chan result, 2)
	for _, owner := range []string{"B", "C"} {
		go func() {
			res, err := s.Claim(ctx, claimAt(scope("k"), owner, "fp", t0))
			results <- result{res, err}
		}()
	}
	waitLockWaits(t, db, 2)
	require.NoError(t, release.Commit())

	var created, existing []idempotency.Record
	for range 2 {
		r := <-results
		require.NoError(t, r.err)
		if r.res.Outcome == idempotency.ClaimCreated {
			created = append(created, r.res.Record)
		} else {
			require.Equal(t, idempotency.ClaimExisting, r.res.Outcome)
			existing = append(existing, r.res.Record)
		}
	}
	require.Len(t, created, 1, "one winner")
	require.Len(t, existing, 1)
	require.Equal(t, created[0].Owner, existing[0].Owner, "the loser names the winner")
	require.EqualValues(t, 1, created[0].Generation)
	require.Positive(t, poolOf(t, db).deadlocks.Load(), "InnoDB reported the deadlock, and the claim was run again")
}

// openMySQLStore opens a migrated store on a fresh database whose pool sets
// the session variables in params (a DSN's unknown parameters are sent as
// SET name=value on each connection).
func openMySQLStore(t *testing.T, params map[string]string) (*sqlstore.Store, *sql.DB) {
	t.Helper()
	cfg := mysqlDatabaseConfig(t)
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	maps.Copy(cfg.Params, params)
	db := openMySQLConfig(t, cfg, nil)
	s, err := sqlstore.Open(db, sqlstore.MySQL)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	return s, db
}

// A statement that waits for a row lock longer than
// innodb_lock_wait_timeout (1 s here) fails with 1205, and the Store runs
// it again within its bound: a claim behind a transaction that holds the
// record succeeds once the lock is gone; a heartbeat behind one that keeps
// it fails after the bound with an *OpError matching ErrSerialization (a
// 503 through the middleware, never a lost lease).
func TestMySQLLockWaitTimeoutIsRetriedWithinTheBound(t *testing.T) {
	s, db := openMySQLStore(t, map[string]string{"innodb_lock_wait_timeout": "1"})
	ctx := t.Context()
	rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	pool := poolOf(t, db)
	lock := func() *sql.Tx {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.Exec(`SELECT generation FROM `+sqlstore.DefaultTable+` WHERE idem_key = $1 FOR UPDATE`, []byte("k"))
		require.NoError(t, err)
		return tx
	}

	holder := lock()
	claim := make(chan error, 1)
	go func() {
		res, err := s.Claim(ctx, claimAt(scope("k"), "B", "fp", t0))
		if err == nil && res.Outcome != idempotency.ClaimExisting {
			err = errors.New("the claim won a live lease")
		}
		claim <- err
	}()
	for pool.lockTimeouts.Load() == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	require.NoError(t, holder.Commit())
	require.NoError(t, <-claim, "the claim ran again after the timeout and answered")

	holder = lock()
	defer func() { _ = holder.Rollback() }()
	before := pool.lockTimeouts.Load()
	err = s.Heartbeat(ctx, rec.Lease(), t0.Add(time.Minute))
	var oe *sqlstore.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "heartbeat", oe.Op)
	require.ErrorIs(t, err, sqlstore.ErrSerialization)
	require.NotErrorIs(t, err, idempotency.ErrLeaseLost)
	require.EqualValues(t, 3, pool.lockTimeouts.Load()-before, "three tries, each timed out")
}

// isolationParam returns the name of the session variable that sets the
// isolation level: transaction_isolation on MySQL 8 (and MariaDB 11.1+),
// tx_isolation on MariaDB before 11.1.
func isolationParam(t *testing.T, db *sql.DB) string {
	t.Helper()
	var v string
	if err := db.QueryRow(`SELECT @@transaction_isolation`).Scan(&v); err == nil {
		return "transaction_isolation"
	}
	return "tx_isolation"
}

// TestMySQLChurnAtEveryIsolationLevel runs the middleware over MySQL at
// each isolation level InnoDB offers, under churn: 24 callers send 384
// requests over 8 keys; the handler writes a row in the request's
// transaction and answers 503 on every third execution of a key (which
// releases it, so the key runs again), while a reaper deletes completed
// records as fast as it can (so keys are claimed afresh). The Store needs
// no particular level: its fences are InnoDB's locking reads, which read
// the latest version at every level. REPEATABLE READ (InnoDB's default)
// and SERIALIZABLE add gap locks (the reaper's range DELETE, the duplicate
// checks) and with them deadlocks and lock waits, which the Store runs
// again. At every level: never two executions of one key at once, every
// answer is a 201 (run or replayed), an in-progress 409 or the handler's
// own 503, never a store failure or a 500, and the business rows are those
// of the executions that answered 201.
func TestMySQLChurnAtEveryIsolationLevel(t *testing.T) {
	probe := openMySQL(t)
	param := isolationParam(t, probe)
	for _, level := range []string{"READ-COMMITTED", "REPEATABLE-READ", "SERIALIZABLE"} {
		t.Run(level, func(t *testing.T) {
			s, db := openMySQLStore(t, map[string]string{param: "'" + level + "'"})
			var got string
			require.NoError(t, db.QueryRow(`SELECT @@`+param).Scan(&got))
			require.Equal(t, level, got)
			_, err := db.Exec(`CREATE TABLE charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key VARCHAR(64) NOT NULL)`)
			require.NoError(t, err)

			var (
				mu           sync.Mutex
				active, runs = map[string]int{}, map[string]int{}
				overlap      int
			)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				key := run.Scope.Key
				mu.Lock()
				active[key]++
				if active[key] > 1 {
					overlap++
				}
				runs[key]++
				n := runs[key]
				mu.Unlock()
				defer func() {
					mu.Lock()
					active[key]--
					mu.Unlock()
				}()
				if n%3 == 0 {
					http.Error(w, "handler: try again", http.StatusServiceUnavailable)
					return
				}
				tx, ok := sqlstore.Tx(r.Context())
				if !ok {
					http.Error(w, "no transaction", http.StatusInternalServerError)
					return
				}
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO charges (idem_key) VALUES (?)`, key); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			mw := idempotency.New(s, idempotency.WithAnonymousKeys(true),
				idempotency.WithLogger(slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))))
			srv := httptest.NewServer(mw.Wrap(h))
			t.Cleanup(srv.Close)

			stop := make(chan struct{})
			reaped := make(chan error, 1)
			go func() {
				for {
					select {
					case <-stop:
						reaped <- nil
						return
					default:
					}
					if _, err := s.DeleteBefore(t.Context(), time.Now(), 4); err != nil {
						reaped <- err
						return
					}
				}
			}()

			const callers, requests, keys = 24, 384, 8
			var next atomic.Int64
			answers := make(chan answer, requests)
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					for i := next.Add(1); i <= requests; i = next.Add(1) {
						answers <- postKey(srv, fmt.Sprintf("k%d", i%keys))
					}
				})
			}
			wg.Wait()
			close(stop)
			require.NoError(t, <-reaped, "the reaper's DELETE")
			close(answers)
			counts := map[string]int{}
			for a := range answers {
				switch {
				case a.status == http.StatusCreated && a.replayed:
					counts["201 replayed"]++
				case a.status == http.StatusCreated:
					counts["201"]++
				case a.status == http.StatusConflict && strings.Contains(a.body, string(idempotency.CodeInProgress)):
					counts["409"]++
				case a.status == http.StatusServiceUnavailable && strings.HasPrefix(a.body, "handler:"):
					counts["handler 503"]++
				default:
					t.Errorf("answer %d %q", a.status, a.body)
				}
			}
			require.Zero(t, overlap, "two executions of one key at once")
			require.Equal(t, counts["201"], count(t, db, `SELECT COUNT(*) FROM charges`),
				"a row for each execution that answered 201, and only those")
			pool := poolOf(t, db)
			t.Logf("%s: answers %v; InnoDB deadlocks %d, lock wait timeouts %d, all run again",
				level, counts, pool.deadlocks.Load(), pool.lockTimeouts.Load())
		})
	}
}

// postKey posts to srv with key, for goroutines other than the test's.
func postKey(srv *httptest.Server, key string) answer {
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":1}`))
	if err != nil {
		return answer{body: err.Error()}
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := srv.Client().Do(req)
	if err != nil {
		return answer{body: err.Error()}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{body: err.Error()}
	}
	return answer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}
