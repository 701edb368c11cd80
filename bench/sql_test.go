package bench

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// openPGSchema opens a pool of at most maxConns connections on a schema of
// its own in SAFERETRY_PG_DSN's database (dropped at cleanup), so that the
// benchmark's tables never meet another run's, and returns it with its
// DSN. It skips without SAFERETRY_PG_DSN.
func openPGSchema(b *testing.B, maxConns int) (*sql.DB, string) {
	b.Helper()
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		b.Skip("SAFERETRY_PG_DSN not set: skipping PostgreSQL benchmarks")
	}
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = admin.Close() })
	r := make([]byte, 6)
	_, _ = rand.Read(r)
	schema := "bench_" + hex.EncodeToString(r)
	if _, err := admin.Exec("CREATE SCHEMA " + schema); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + schema + " CASCADE") })
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	dsn += sep + "search_path=" + schema
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		b.Fatal(err)
	}
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	b.Cleanup(func() { _ = db.Close() })
	return db, dsn
}

// pgStore opens a migrated sqlstore.Store on db.
func pgStore(b *testing.B, db *sql.DB) *sqlstore.Store {
	b.Helper()
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	return s
}

// latencies collects request durations from many goroutines.
type latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

func (l *latencies) add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, d)
	l.mu.Unlock()
}

// quantile returns the q-quantile (0 < q <= 1) of what was added.
func (l *latencies) quantile(q float64) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.d) == 0 {
		return 0
	}
	slices.Sort(l.d)
	return l.d[min(len(l.d)-1, int(q*float64(len(l.d))))]
}

// envInt reads a positive integer from the environment, or def.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// BenchmarkReaperLive measures what the Reaper costs live traffic on
// PostgreSQL while it works off a backlog of expired records (default
// 1,000,000, BENCH_REAP_RECORDS), completed 100 hours ago, past the 72-hour
// cleanup horizon. Live traffic is BENCH_REAP_CLIENTS (default 4) callers
// of the middleware with fresh keys, on the same table, all along. Each of
// the b.N rounds has three windows of 250 ms, in an order that rotates
// each round: quiet (no reaping), reaper (Reaper.ReapOnce in a loop,
// canceled at the window's end: batches of 100, each followed by a pause
// as long), and unpaced (DeleteBefore batches of 500 back to back: a
// Reaper that does not yield). A live request's latency falls in the
// window it started in. It reports live p50 and p99 in each, p99-ratio
// (reaper over quiet: the goal is at most 1.5), unpaced-p99-ratio (unpaced
// over quiet), and the rate of each while it ran (reaped-rows/s: the goal
// is at least 10,000).
//
//	cd bench && SAFERETRY_PG_DSN=... go test -run '^$' -bench 'BenchmarkReaperLive$' -benchtime 20x -timeout 30m .
func BenchmarkReaperLive(b *testing.B) {
	records := envInt("BENCH_REAP_RECORDS", 1_000_000)
	clients := envInt("BENCH_REAP_CLIENTS", 4)
	const window = 250 * time.Millisecond
	db, _ := openPGSchema(b, clients+4)
	s := pgStore(b, db)
	old := time.Now().Add(-100 * time.Hour).UnixNano()
	if _, err := db.Exec(`INSERT INTO `+sqlstore.DefaultTable+`
SELECT sha256(int8send(g)), 'bench', 'POST', '/orders', int8send(g), 2, 'fp', 1, 'o', 1, $1, '', NULL, NULL,
	201, NULL, '{"id":"ord_1","status":"created"}', $1, $1, $1
FROM generate_series(1, $2::bigint) g`, old, records); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(`VACUUM ANALYZE ` + sqlstore.DefaultTable); err != nil {
		b.Fatal(err)
	}
	m := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil }),
		idempotency.WithLogger(DiscardLogger))
	h := m.Wrap(http.HandlerFunc(created))
	reaper := m.Reaper()

	const (
		quiet = iota
		paced
		unpaced
	)
	var (
		open   atomic.Int32 // the window now open
		lat    [3]latencies
		stop   atomic.Bool
		wg     sync.WaitGroup
		seq    atomic.Int64
		failed atomic.Int64
	)
	for range clients {
		wg.Go(func() {
			for !stop.Load() {
				req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"amount":1}`))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", fmt.Sprint("live-", seq.Add(1)))
				rec := httptest.NewRecorder()
				w, start := open.Load(), time.Now()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusCreated {
					failed.Add(1)
				}
				lat[w].add(time.Since(start))
			}
		})
	}
	var (
		deleted [3]int
		busy    [3]time.Duration
	)
	b.ResetTimer()
	for round := range b.N {
		for i := range 3 {
			w := (i + round) % 3
			ctx, cancel := context.WithTimeout(context.Background(), window)
			open.Store(int32(w))
			start := time.Now()
			for ctx.Err() == nil {
				switch w {
				case quiet:
					<-ctx.Done()
				case paced:
					rep, _ := reaper.ReapOnce(ctx, time.Now())
					deleted[w] += rep.Deleted
				case unpaced:
					n, _ := s.DeleteBefore(ctx, time.Now().Add(-72*time.Hour), 500)
					deleted[w] += n
				}
			}
			busy[w] += time.Since(start)
			cancel()
		}
	}
	b.StopTimer()
	stop.Store(true)
	wg.Wait()
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d live requests failed", n)
	}
	for w, name := range []string{"quiet", "reaper", "unpaced"} {
		b.ReportMetric(float64(lat[w].quantile(0.5).Microseconds()), name+"-p50-us")
		b.ReportMetric(float64(lat[w].quantile(0.99).Microseconds()), name+"-p99-us")
	}
	b.ReportMetric(float64(lat[paced].quantile(0.99))/float64(lat[quiet].quantile(0.99)), "p99-ratio")
	b.ReportMetric(float64(lat[unpaced].quantile(0.99))/float64(lat[quiet].quantile(0.99)), "unpaced-p99-ratio")
	b.ReportMetric(float64(deleted[paced])/busy[paced].Seconds(), "reaped-rows/s")
	b.ReportMetric(float64(deleted[unpaced])/busy[unpaced].Seconds(), "unpaced-rows/s")
}

// BenchmarkFleetInsert compares, on PostgreSQL, a handler that makes one
// business INSERT in autocommit (bare) with the same handler behind the
// middleware, which makes the INSERT through sqlstore.Tx, in the
// transaction that stores the response (claim, BEGIN, INSERT, UPDATE,
// COMMIT: two commits), and behind a middleware made
// WithOneTransaction(true) (onetx: BEGIN, claim, INSERT, UPDATE, COMMIT:
// one commit), at 16 and 64 concurrent clients, and the one-transaction
// protocol written by hand without the library (floor, at 64), with a
// fresh key per request and ServeHTTP called directly (no network). The
// seven variants run
// interleaved in rounds (their order rotating), so that a shared machine's
// drift falls on all alike. It reports each variant's requests per second,
// ratio-c16 and ratio-c64 (middleware over bare), ratio-onetx-c16 and
// ratio-onetx-c64 (one transaction over bare: the goal is 0.5 or more at
// 64), ratio-floor-c64 and onetx-over-floor-c64 (the hand-written
// protocol over bare, and the library over it), the gain of each from 16 to 64 clients (scale-*), and, sampled from
// pg_stat_activity while the middleware runs at 64 clients, how many of the
// pool's backends are idle in a transaction on average (idle-in-tx) and
// how many of those sit after the library's own completion, before its COMMIT
// (idle-after-update). The pool has BENCH_PG_CONNS connections (default
// 64): PostgreSQL's max_connections must leave room for them.
//
//	cd bench && SAFERETRY_PG_DSN=... go test -run '^$' -bench 'BenchmarkFleetInsert$' -benchtime 6x -timeout 30m .
func BenchmarkFleetInsert(b *testing.B) {
	conns := envInt("BENCH_PG_CONNS", 64)
	app := fmt.Sprintf("fleet_%d", time.Now().UnixNano()%1e9)
	_, dsn := openPGSchema(b, 1)
	db, err := sql.Open("pgx", dsn+"&application_name="+app)
	if err != nil {
		b.Fatal(err)
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	b.Cleanup(func() { _ = db.Close() })
	s := pgStore(b, db)
	if _, err := db.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	const insert = `INSERT INTO orders (id, amount) VALUES ($1, $2)`
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := db.ExecContext(r.Context(), insert, r.Header.Get("Idempotency-Key"), 4200); err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	inTx := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if _, err := tx.ExecContext(r.Context(), insert, r.Header.Get("Idempotency-Key"), 4200); err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	// floor is the one-transaction protocol written by hand, on a table
	// of its own without the library: BEGIN, a claim INSERT, the business
	// INSERT, a completion UPDATE, COMMIT. What it loses to bare is the
	// protocol's; what onetx loses to it, the library's.
	if _, err := db.Exec(`CREATE TABLE floor_claims (key TEXT PRIMARY KEY, state SMALLINT NOT NULL,
	status INTEGER, body BYTEA)`); err != nil {
		b.Fatal(err)
	}
	floor := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		err := func() error {
			tx, err := db.BeginTx(r.Context(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			res, err := tx.ExecContext(r.Context(),
				`INSERT INTO floor_claims (key, state) VALUES ($1, 1) ON CONFLICT DO NOTHING`, key)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil || n != 1 {
				return fmt.Errorf("claimed %d: %v", n, err)
			}
			if _, err := tx.ExecContext(r.Context(), insert, key, 4200); err != nil {
				return err
			}
			if _, err := tx.ExecContext(r.Context(),
				`UPDATE floor_claims SET state = 2, status = 201, body = $2 WHERE key = $1 AND state = 1`,
				key, []byte{}); err != nil {
				return err
			}
			return tx.Commit()
		}()
		if err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	principal := idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil })
	guarded := idempotency.New(s, principal, idempotency.WithLogger(DiscardLogger)).Wrap(inTx)
	oneTx := idempotency.New(s, principal, idempotency.WithLogger(DiscardLogger),
		idempotency.WithOneTransaction(true)).Wrap(inTx)
	var seq atomic.Int64
	run := func(h http.Handler) {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"amount":4200}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", fmt.Sprint("ord-", seq.Add(1)))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusCreated {
			b.Errorf("status %d", rec.Code)
		}
	}
	type variant struct {
		name string
		h    http.Handler
		conc int
	}
	variants := []variant{{"bare-c16", bare, 16}, {"middleware-c16", guarded, 16},
		{"bare-c64", bare, 64}, {"middleware-c64", guarded, 64},
		{"onetx-c16", oneTx, 16}, {"onetx-c64", oneTx, 64}, {"floor-c64", floor, 64}}
	admin, err := sql.Open("pgx", os.Getenv("SAFERETRY_PG_DSN"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = admin.Close() })
	var samples, idle, afterUpdate int
	sample := func(stop <-chan struct{}, done chan<- struct{}) {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			rows, err := admin.Query(`SELECT query FROM pg_stat_activity
WHERE application_name = $1 AND state = 'idle in transaction'`, app)
			if err != nil {
				continue
			}
			samples++
			for rows.Next() {
				var q string
				if rows.Scan(&q) == nil {
					idle++
					if strings.Contains(q, "SET state = 2") { // the completion
						afterUpdate++
					}
				}
			}
			_ = rows.Close()
		}
	}
	const batch = 512
	for _, v := range variants { // warm-up: connections, statements
		parallelRun(64, v.conc, func() { run(v.h) })
	}
	spent := make([]time.Duration, len(variants))
	b.ResetTimer()
	for round := range b.N {
		for i := range variants {
			j := (i + round) % len(variants)
			v := variants[j]
			var stop, done chan struct{}
			if v.name == "middleware-c64" {
				stop, done = make(chan struct{}), make(chan struct{})
				go sample(stop, done)
			}
			start := time.Now()
			parallelRun(batch, v.conc, func() { run(v.h) })
			spent[j] += time.Since(start)
			if stop != nil {
				close(stop)
				<-done
			}
		}
	}
	b.StopTimer()
	rps := make([]float64, len(variants))
	for i, v := range variants {
		rps[i] = float64(b.N*batch) / spent[i].Seconds()
		b.ReportMetric(rps[i], v.name+"-req/s")
	}
	b.ReportMetric(rps[1]/rps[0], "ratio-c16")
	b.ReportMetric(rps[3]/rps[2], "ratio-c64")
	b.ReportMetric(rps[4]/rps[0], "ratio-onetx-c16")
	b.ReportMetric(rps[5]/rps[2], "ratio-onetx-c64")
	b.ReportMetric(rps[6]/rps[2], "ratio-floor-c64")
	b.ReportMetric(rps[5]/rps[6], "onetx-over-floor-c64")
	b.ReportMetric(rps[2]/rps[0], "scale-bare")
	b.ReportMetric(rps[3]/rps[1], "scale-middleware")
	if samples > 0 {
		b.ReportMetric(float64(idle)/float64(samples), "idle-in-tx")
		b.ReportMetric(float64(afterUpdate)/float64(samples), "idle-after-update")
	}
}

// parallelRun runs op n times in total from conc goroutines.
func parallelRun(n, conc int, op func()) {
	var left atomic.Int64
	left.Store(int64(n))
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				op()
			}
		})
	}
	wg.Wait()
}
