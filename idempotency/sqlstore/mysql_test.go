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
	"regexp"
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
		`CREATE TABLE orders (id VARCHAR(255) PRIMARY KEY, amount INTEGER NOT NULL,
			customer TEXT NOT NULL)`,
	} {
		_, err := db.Exec(s)
		require.NoError(t, err, s)
	}
	checkAtCommit(t, db, `SELECT COUNT(*) FROM orders o
		LEFT JOIN customers c ON c.id = o.customer WHERE c.id IS NULL`)
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
			rows, err := db.Query(`SELECT p.ID, p.DB, p.COMMAND, p.STATE, p.INFO,
					COALESCE(t.trx_state, '')
				FROM information_schema.PROCESSLIST p
				LEFT JOIN information_schema.INNODB_TRX t ON p.ID = t.trx_mysql_thread_id
				WHERE p.DB = DATABASE()`)
			require.NoError(t, err)
			for rows.Next() {
				var id int64
				var db, cmd, state, info, trx sql.NullString
				require.NoError(t, rows.Scan(&id, &db, &cmd, &state, &info, &trx))
				t.Logf("session %d: %s %s %q %q trx %s", id, db.String, cmd.String, state.String,
					info.String, trx.String)
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
	require.NoError(t, db.QueryRow(`SELECT scope_hash FROM `+sqlstore.DefaultTable+
		` WHERE idem_key = $1`, []byte("k")).Scan(&hash))

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
	require.Positive(t, poolOf(t, db).deadlocks.Load(),
		"InnoDB reported the deadlock, and the claim was run again")
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
		_, err = tx.Exec(`SELECT generation FROM `+sqlstore.DefaultTable+
			` WHERE idem_key = $1 FOR UPDATE`, []byte("k"))
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
			_, err := db.Exec(`CREATE TABLE charges (id BIGINT AUTO_INCREMENT PRIMARY KEY,
				idem_key VARCHAR(64) NOT NULL)`)
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
				const insert = `INSERT INTO charges (idem_key) VALUES (?)`
				if _, err := tx.ExecContext(r.Context(), insert, key); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			mw := idempotency.New(s, idempotency.WithAnonymousKeys(true),
				idempotency.WithLogger(slog.New(slog.NewTextHandler(testWriter{t},
					&slog.HandlerOptions{Level: slog.LevelWarn}))))
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
				case a.status == http.StatusConflict &&
					strings.Contains(a.body, string(idempotency.CodeInProgress)):
					counts["409"]++
				case a.status == http.StatusServiceUnavailable &&
					strings.HasPrefix(a.body, "handler:"):
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
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/charges",
		strings.NewReader(`{"amount":1}`))
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
	return answer{status: resp.StatusCode, body: string(b),
		replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// Open identifies MySQL and MariaDB by @@version and refuses a MySQL pool
// declared as another dialect, and another database declared MySQL, with
// a *DialectError naming both.
func TestMySQLOpenRefusesAMismatchedDialect(t *testing.T) {
	server := regexp.MustCompile(`^(MySQL|MariaDB) [0-9]+\.[0-9]+`)
	my := openMySQL(t)
	for _, declared := range []sqlstore.Dialect{sqlstore.Postgres, sqlstore.SQLite} {
		_, err := sqlstore.Open(my, declared)
		var de *sqlstore.DialectError
		require.ErrorAs(t, err, &de, "declared %v", declared)
		require.Equal(t, declared, de.Declared)
		require.Equal(t, sqlstore.MySQL, de.Found)
		require.Regexp(t, server, de.Server)
		require.Contains(t, err.Error(), "mysql")
	}
	_, err := sqlstore.Open(my, sqlstore.MySQL)
	require.NoError(t, err)

	for _, o := range []struct {
		open  func(testing.TB) *sql.DB
		found sqlstore.Dialect
	}{{openSQLite, sqlstore.SQLite}, {openPG, sqlstore.Postgres}} {
		t.Run(o.found.String(), func(t *testing.T) {
			_, err := sqlstore.Open(o.open(t), sqlstore.MySQL)
			var de *sqlstore.DialectError
			require.ErrorAs(t, err, &de)
			require.Equal(t, sqlstore.MySQL, de.Declared)
			require.Equal(t, o.found, de.Found)
			require.Contains(t, err.Error(), "mysql")
		})
	}
}

// Migrate creates the table with its two indexes, (state, lease_until) for
// the Completer and (state, completed_at) for the Reaper, in one CREATE
// TABLE IF NOT EXISTS: a second run, and four at once, change nothing and
// keep the records; Schema is that statement.
func TestMySQLMigrateTwiceAndConcurrently(t *testing.T) {
	s, db := newStore(t, mysqlBackend(t))
	ctx := t.Context()
	require.True(t, strings.HasPrefix(s.Schema(),
		"CREATE TABLE IF NOT EXISTS "+sqlstore.DefaultTable+" ("))
	require.Contains(t, s.Schema(), "scope_hash          BINARY(32) NOT NULL PRIMARY KEY")
	rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	require.NoError(t, s.Complete(ctx, rec.Lease(),
		idempotency.Response{Status: 201, Body: []byte("ok")}, t0))

	require.NoError(t, s.Migrate(ctx), "a second Migrate")
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			other, err := sqlstore.Open(db, sqlstore.MySQL)
			if err == nil {
				err = other.Migrate(ctx)
			}
			errs <- err
		}()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
	got, err := s.Get(ctx, scope("k"))
	require.NoError(t, err)
	require.Equal(t, "ok", string(got.Response.Body))
	rows, err := db.Query(`SELECT index_name, GROUP_CONCAT(column_name ORDER BY seq_in_index)
		FROM information_schema.STATISTICS WHERE table_schema = DATABASE() AND table_name = $1
		GROUP BY index_name ORDER BY index_name`, sqlstore.DefaultTable)
	require.NoError(t, err)
	var indexes []string
	for rows.Next() {
		var name, cols string
		require.NoError(t, rows.Scan(&name, &cols))
		indexes = append(indexes, name+"("+cols+")")
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	require.Equal(t, []string{"idempotency_records_done_idx(state,completed_at)",
		"idempotency_records_pending_idx(state,lease_until)", "PRIMARY(scope_hash)"}, indexes,
		"the primary key and an index for each background job, nothing else")
	var engine string
	require.NoError(t, db.QueryRow(`SELECT engine FROM information_schema.TABLES
		WHERE table_schema = DATABASE() AND table_name = $1`, sqlstore.DefaultTable).Scan(&engine))
	require.Equal(t, "InnoDB", engine)
}

// TestMySQLScopeHashMatchesDocumentedSQL checks the package
// documentation's MySQL expression for the primary key against the rows
// the Store wrote, for scopes of odd bytes and lengths.
func TestMySQLScopeHashMatchesDocumentedSQL(t *testing.T) {
	s, db := newStore(t, mysqlBackend(t))
	for i, sc := range []idempotency.Scope{
		{Principal: "acct", Method: "POST", Route: "/pay/\xff", Key: "k"},
		{Principal: "", Method: "", Route: "", Key: ""},
		{Principal: "a\x00", Method: "POST", Route: strings.Repeat("r", 5000), Key: "order 42"},
	} {
		_, won, err := claimed(s.Claim(t.Context(), claimAt(sc, "o", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won, "scope %d", i)
	}
	require.Equal(t, 3, count(t, db, `SELECT COUNT(*) FROM `+sqlstore.DefaultTable+`
	WHERE scope_hash =
	UNHEX(SHA2(CONCAT(UNHEX(LPAD(HEX(LENGTH(principal)), 16, '0')), principal,
	                  UNHEX(LPAD(HEX(LENGTH(method)), 16, '0')), method,
	                  UNHEX(LPAD(HEX(LENGTH(route)), 16, '0')), route,
	                  UNHEX(LPAD(HEX(LENGTH(idem_key)), 16, '0')), idem_key), 256))`))
}

// MySQL reports the rows an UPDATE changed, not those it matched (unless
// the DSN sets clientFoundRows=true): a heartbeat to the lease end the
// record has (one that ends it included), or a recovery point equal to the stored
// one, alone or in a unit (with its transaction begun or not), changes no
// row. Each still succeeds while the
// lease holds, and fails with ErrLeaseLost once a successor has it, with
// either setting of clientFoundRows.
func TestMySQLWriteThatChangesNothingKeepsTheLease(t *testing.T) {
	for _, foundRows := range []bool{false, true} {
		t.Run(fmt.Sprintf("clientFoundRows=%v", foundRows), func(t *testing.T) {
			cfg := mysqlDatabaseConfig(t)
			cfg.ClientFoundRows = foundRows
			db := openMySQLConfig(t, cfg, nil)
			s, err := sqlstore.Open(db, sqlstore.MySQL)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			ctx := t.Context()
			rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
			require.NoError(t, err)
			require.True(t, won)
			l := rec.Lease()
			until := t0.Add(time.Minute)
			for range 2 {
				require.NoError(t, s.Heartbeat(ctx, l, until))
				require.NoError(t, s.SetRecoveryPoint(ctx, l, "p", []byte("d"), t0))
			}
			// In a unit whose transaction began (as a handler's Tx call
			// begins it), and in one that never began one.
			u, uctx, err := s.Begin(ctx, l)
			require.NoError(t, err)
			_, began := sqlstore.Tx(uctx)
			require.True(t, began)
			require.NoError(t, u.SetRecoveryPoint(ctx, "p", []byte("d"), t0), "in a unit")
			require.NoError(t, u.Commit())
			u, _, err = s.Begin(ctx, l)
			require.NoError(t, err)
			require.NoError(t, u.SetRecoveryPoint(ctx, "p", []byte("d"), t0))
			require.NoError(t, u.Commit(), "in a unit without a transaction")
			for range 2 {
				require.NoError(t, s.Heartbeat(ctx, l, t0.Add(time.Second))) // ends the lease
			}

			_, won, err = claimed(s.Claim(ctx,
				claimAt(scope("k"), "B", "fp", t0.Add(2*time.Second))))
			require.NoError(t, err)
			require.True(t, won, "the ended lease is taken over")
			require.ErrorIs(t, s.Heartbeat(ctx, l, until), idempotency.ErrLeaseLost)
			require.ErrorIs(t, s.SetRecoveryPoint(ctx, l, "p", []byte("d"), t0),
				idempotency.ErrLeaseLost)
			u, uctx, err = s.Begin(ctx, l)
			require.NoError(t, err)
			_, began = sqlstore.Tx(uctx)
			require.True(t, began)
			require.ErrorIs(t, u.SetRecoveryPoint(ctx, "p", []byte("d"), t0),
				idempotency.ErrLeaseLost)
			require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost)
			u, _, err = s.Begin(ctx, l)
			require.NoError(t, err)
			require.NoError(t, u.SetRecoveryPoint(ctx, "p", []byte("d"), t0), "kept for Commit")
			require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost)
		})
	}
}
