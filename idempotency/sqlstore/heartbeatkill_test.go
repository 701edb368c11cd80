package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// killLease returns the lease of the tests that terminate backends: 3 s
// (a heartbeat every second, each with 1.5 s of tries), long beside the
// terminations every 100-150 ms, and beside the time a connection takes
// to open on a loaded machine (up to 1 s, seen at a load of 30 on two
// cores); SAFERETRY_KILL_LEASE (a time.ParseDuration) sets another, such
// as the 600 ms of a probe.
func killLease(t *testing.T) time.Duration {
	t.Helper()
	v := os.Getenv("SAFERETRY_KILL_LEASE")
	if v == "" {
		return 3 * time.Second
	}
	d, err := time.ParseDuration(v)
	require.NoError(t, err, "SAFERETRY_KILL_LEASE")
	return d
}

// backendKiller ends the server connections of one test's pool, found by
// their application_name (PostgreSQL) or their database (MariaDB), never
// another test's or session's. idle and busy end up to n of them, picked at
// random, and return the ids of those they ended (an id may come again
// while its end is under way).
type backendKiller struct {
	db *sql.DB // the test's pool
	// idle ends the pool's connections that wait for a statement.
	idle func(ctx context.Context, n int) ([]int64, error)
	// busy ends the pool's connections that run a statement.
	busy func(ctx context.Context, n int) ([]int64, error)
	// lock takes the row lock of the record of key in a transaction of
	// its own, which the returned function ends.
	lock func(ctx context.Context, key string) (func(), error)
}

// maxConns is the size of the pools of the tests that terminate
// connections.
const maxConns = 16

// pgKiller opens a PostgreSQL pool of at most maxConns connections whose
// application_name is the test's own, and its killer.
func pgKiller(t *testing.T) backendKiller {
	t.Helper()
	base := pgSchemaDSN(t)
	app := "hb_" + randHex(6)
	db, err := sql.Open("pgx", withParam(base, "application_name", app))
	require.NoError(t, err)
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	t.Cleanup(func() { _ = db.Close() })
	admin, err := sql.Open("pgx", base)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	terminate := func(state string) func(ctx context.Context, n int) ([]int64, error) {
		return func(ctx context.Context, n int) ([]int64, error) {
			// Materialized first: the planner may not call
			// pg_terminate_backend on any other backend.
			return ids(admin.QueryContext(ctx, `WITH mine AS MATERIALIZED (
	SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = $2
	ORDER BY random() LIMIT $3)
SELECT pid FROM mine WHERE pg_terminate_backend(pid)`, app, state, n))
		}
	}
	return backendKiller{
		db: db, idle: terminate("idle"), busy: terminate("active"),
		lock: func(ctx context.Context, key string) (func(), error) {
			return lockRecord(ctx, admin, `SELECT 1 FROM `+sqlstore.DefaultTable+
				` WHERE idem_key = $1 FOR UPDATE`, key)
		},
	}
}

// mysqlKiller opens a MariaDB pool of at most maxConns connections (as
// openMySQLConfig does) on a database of the test's own, and its killer,
// whose own connections use another database.
func mysqlKiller(t *testing.T) backendKiller {
	t.Helper()
	cfg := mysqlDatabaseConfig(t)
	name := cfg.DBName
	cfg.Logger = &mysql.NopLogger{} // the driver's notes on the connections the test ends
	db := openMySQLConfig(t, cfg, nil)
	admin, err := sql.Open("mysql", mysqlDSN(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	kill := func(command string) func(ctx context.Context, n int) ([]int64, error) {
		return func(ctx context.Context, n int) ([]int64, error) {
			found, err := ids(admin.QueryContext(ctx, `SELECT id FROM information_schema.PROCESSLIST
WHERE db = ? AND `+command+` ORDER BY RAND() LIMIT ?`, name, n))
			if err != nil {
				return nil, err
			}
			var ended []int64
			for _, id := range found {
				_, err := admin.ExecContext(ctx, fmt.Sprintf("KILL %d", id))
				var me *mysql.MySQLError
				switch {
				case errors.As(err, &me) && me.Number == 1094: // gone meanwhile
				case err != nil:
					return ended, err
				default:
					ended = append(ended, id)
				}
			}
			return ended, nil
		}
	}
	return backendKiller{
		db: db, idle: kill(`command = 'Sleep'`), busy: kill(`command IN ('Query', 'Execute')`),
		lock: func(ctx context.Context, key string) (func(), error) {
			return lockRecord(ctx, admin, `SELECT 1 FROM `+name+`.`+sqlstore.DefaultTable+
				` WHERE idem_key = ? FOR UPDATE`, key)
		},
	}
}

// ids reads a column of ids.
func ids(rows *sql.Rows, err error) ([]int64, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var found []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		found = append(found, id)
	}
	return found, rows.Err()
}

// lockRecord runs query (a SELECT ... FOR UPDATE of the record of key) in
// a transaction of admin's, and returns the function that rolls it back.
func lockRecord(ctx context.Context, admin *sql.DB, query, key string) (func(), error) {
	tx, err := admin.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	var one int
	if err := tx.QueryRowContext(ctx, query, []byte(key)).Scan(&one); err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	return func() { _ = tx.Rollback() }, nil
}

// killBackend is a backend of the tests that terminate connections.
type killBackend struct {
	name string
	open func(t *testing.T) backendKiller
	d    sqlstore.Dialect
}

var killBackends = []killBackend{
	{"postgres", pgKiller, sqlstore.Postgres},
	{"mysql", mysqlKiller, sqlstore.MySQL},
}

// longCalls runs long calls of Do (each two leases of killLease long, its
// fn honouring its context) on a store over a killer's pool, and counts
// what happened to them.
type longCalls struct {
	mw       *idempotency.Middleware
	lease    time.Duration
	hold     time.Duration
	mu       sync.Mutex
	runs     map[string]int // executions of fn, by key
	stopped  int            // executions whose context was canceled
	causes   []error        // why, for the first few
	failures atomic.Int64   // heartbeat tries that failed (not ErrLeaseLost)
}

// newLongCalls opens b's pool, its killer and the store of its long calls.
func newLongCalls(t *testing.T, b killBackend) (*longCalls, backendKiller) {
	t.Helper()
	k := b.open(t)
	s, err := sqlstore.Open(k.db, b.d)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	lease := killLease(t)
	c := &longCalls{lease: lease, hold: 2 * lease, runs: map[string]int{}}
	c.mw = idempotency.New(s, idempotency.WithLease(lease),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)),
		idempotency.WithObserver(idempotency.Observer{StoreCall: func(_ context.Context, e idempotency.Event) {
			if e.Op == idempotency.OpHeartbeat && e.Err != nil && !errors.Is(e.Err, idempotency.ErrLeaseLost) {
				c.failures.Add(1)
			}
		}}))
	return c, k
}

// call calls Do for key until it returns fn's output, as a job whose calls
// fail while the store does would, for at most 30 s.
func (c *longCalls) call(t *testing.T, key string) {
	fn := func(ctx context.Context, _ *idempotency.Run) ([]byte, error) {
		started := time.Now()
		c.mu.Lock()
		c.runs[key]++
		c.mu.Unlock()
		select {
		case <-time.After(c.hold):
			return []byte("done " + key), nil
		case <-ctx.Done():
			c.mu.Lock()
			c.stopped++
			if len(c.causes) < 3 {
				c.causes = append(c.causes, fmt.Errorf("%s after %v: %w", key,
					time.Since(started).Round(time.Millisecond), context.Cause(ctx)))
			}
			c.mu.Unlock()
			return nil, context.Cause(ctx)
		}
	}
	call := idempotency.Call{Principal: "acct", Operation: "charge", Key: key}
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := c.mw.Do(t.Context(), call, fn)
		if err == nil {
			assert.Equal(t, "done "+key, string(res.Output))
			return
		}
		if time.Now().After(deadline) {
			assert.NoError(t, err, "key %s never completed", key)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// repeated returns how many keys ran more than once, and the executions.
func (c *longCalls) repeated() (keys, runs int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.runs {
		runs += n
		if n > 1 {
			keys++
		}
	}
	return keys, runs
}

// A long handler's heartbeats go on while the pool's connections die
// under them: every 100-150 ms, every idle connection of the test's pool
// and one that runs a statement at that moment are terminated
// (pg_terminate_backend; KILL on MariaDB) while six calls of Do, each as
// long as two leases, run. A heartbeat that fails on a dead connection
// is tried again on a fresh one while the lease holds: no handler is
// stopped, none runs twice.
func TestHeartbeatsSurviveTerminatedBackends(t *testing.T) {
	for _, b := range killBackends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			c, k := newLongCalls(t, b)
			const calls = 6
			ended := map[int64]bool{}
			stop := make(chan struct{})
			var killer sync.WaitGroup
			killer.Go(func() {
				rng := rand.New(rand.NewPCG(36, 4))
				for {
					select {
					case <-stop:
						return
					case <-time.After(time.Duration(100+rng.IntN(51)) * time.Millisecond):
					}
					idle, err := k.idle(context.Background(), maxConns)
					assert.NoError(t, err)
					busy, err := k.busy(context.Background(), 1)
					assert.NoError(t, err)
					for _, id := range append(idle, busy...) {
						ended[id] = true
					}
				}
			})
			var wg sync.WaitGroup
			for i := range calls {
				wg.Go(func() { c.call(t, fmt.Sprint("k", i)) })
			}
			wg.Wait()
			close(stop)
			killer.Wait()

			keys, runs := c.repeated()
			t.Logf("%s: %d calls, %d handlers stopped, %d keys run again (%d executions); "+
				"%d connections terminated, %d heartbeat tries failed",
				b.name, calls, c.stopped, keys, runs, len(ended), c.failures.Load())
			require.NotEmpty(t, ended, "no connection was terminated")
			require.Zero(t, c.stopped, "handlers stopped while their lease held: %v", c.causes)
			require.Zero(t, keys, "keys whose work ran again")
			require.Equal(t, calls, runs)
		})
	}
}

// A heartbeat whose connection is terminated while its statement runs (a
// busy backend: the test holds the record's row lock, so that the
// heartbeat waits for it) is tried again on a fresh connection. Twice in a
// handler's life, the first two tries of the heartbeat that waits are
// terminated before the lock is let go: the third gets through while the
// lease holds, and the handler runs on, once.
func TestHeartbeatSurvivesItsBusyBackendTerminated(t *testing.T) {
	for _, b := range killBackends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			c, k := newLongCalls(t, b)
			done := make(chan struct{})
			go func() {
				defer close(done)
				c.call(t, "busy")
			}()
			ctx := t.Context()
			require.Eventually(t, func() bool {
				c.mu.Lock()
				defer c.mu.Unlock()
				return c.runs["busy"] == 1
			}, 10*time.Second, time.Millisecond, "the call did not start")
			ended := map[int64]bool{}
			for i := range 2 {
				release, err := k.lock(ctx, "busy")
				require.NoError(t, err, "lock %d", i)
				t.Cleanup(release) // when the test fails while it holds the lock
				deadline := time.Now().Add(5 * time.Second)
				for n := len(ended); len(ended) < n+2; {
					require.True(t, time.Now().Before(deadline), "no heartbeat waited for the lock")
					ids, err := k.busy(ctx, maxConns)
					require.NoError(t, err)
					for _, id := range ids {
						ended[id] = true
					}
					time.Sleep(time.Millisecond)
				}
				release()
				time.Sleep(c.lease / 2)
			}
			<-done
			keys, runs := c.repeated()
			t.Logf("%s: %d busy connections terminated, %d heartbeat tries failed, "+
				"%d handlers stopped, %d executions", b.name, len(ended), c.failures.Load(), c.stopped, runs)
			require.GreaterOrEqual(t, c.failures.Load(), int64(4), "the terminated heartbeats failed")
			require.Zero(t, c.stopped, "the handler was stopped while its lease held: %v", c.causes)
			require.Zero(t, keys)
			require.Equal(t, 1, runs)
		})
	}
}
