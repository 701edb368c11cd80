package sqlstore_test

import (
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// BenchmarkPostgres compares, on the same PostgreSQL database in the same
// run and with a distinct key per request, at 1 and 16 concurrent callers:
//
//   - middleware: a guarded request (httptest recorder, no network) whose
//     handler writes nothing to the database;
//   - store: the Store's own two calls for such a request, Claim and
//     Complete outside a unit (what the middleware sends when the handler
//     asked for no transaction);
//   - handwritten: the smallest thing that could replace them, the same two
//     statements written by hand on a table of its own: an INSERT ... ON
//     CONFLICT DO NOTHING RETURNING claim and a conditional UPDATE storing
//     the response. The table has two partial indexes (claims in progress
//     by lease end, for finding abandoned ones, and completed ones by
//     update time, for cleanup), the Store's layout, which a hand-written
//     lease table needs in some form.
//
// Each sub-benchmark cN runs the three variants interleaved: rounds of
// batch requests per variant, the variants' order rotating each round, so
// that a shared machine's drift falls on all three alike. It reports each
// variant's time and allocations per request and the throughput ratios
// handwritten time / middleware time and handwritten time / store time.
// Run (repeat with -count to see the spread):
//
//	SAFERETRY_PG_DSN=... go test -run '^$' -bench 'Benchmark(Postgres|SQLite)$' -benchtime 3000x ./idempotency/sqlstore/
func BenchmarkPostgres(b *testing.B) {
	db := openPG(b)
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	benchStore(b, db, sqlstore.Postgres, `CREATE TABLE bench_plain (
		id TEXT PRIMARY KEY, owner TEXT NOT NULL, state SMALLINT NOT NULL, lease_until BIGINT NOT NULL,
		status INTEGER, body BYTEA, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL)`)
}

// BenchmarkSQLite is BenchmarkPostgres on a SQLite file opened with
// SQLiteDSN (8 connections).
func BenchmarkSQLite(b *testing.B) {
	db := openSQLite(b)
	benchStore(b, db, sqlstore.SQLite, `CREATE TABLE bench_plain (
		id TEXT PRIMARY KEY, owner TEXT NOT NULL, state SMALLINT NOT NULL, lease_until BIGINT NOT NULL,
		status INTEGER, body BLOB, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL)`)
}

func benchStore(b *testing.B, db *sql.DB, d sqlstore.Dialect, plainDDL string) {
	s, err := sqlstore.Open(db, d)
	require.NoError(b, err)
	require.NoError(b, s.Migrate(b.Context()))
	for _, stmt := range []string{plainDDL,
		`CREATE INDEX bench_plain_pending_idx ON bench_plain (lease_until) WHERE state = 1`,
		`CREATE INDEX bench_plain_done_idx ON bench_plain (updated_at) WHERE state = 2`} {
		_, err = db.Exec(stmt)
		require.NoError(b, err)
	}

	const reqBody = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
	respBody := []byte(`{"id":"pay_1","status":"succeeded"}`)
	run := fmt.Sprint(time.Now().UnixNano())
	// Keys are random, as the Transport's default keys (UUIDv4) are: a
	// sequential key would let the hand-written table's primary key grow
	// at its right edge only, which real traffic never does (the Store's
	// key is a digest, random either way).
	key := func() string { return "bench-" + randHex(16) }

	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(respBody)
	})
	mw := idempotency.New(s,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))).Wrap(h)

	claim := `INSERT INTO bench_plain (id, owner, state, lease_until, created_at, updated_at) VALUES ($1, $2, 1, $3, $4, $4)
ON CONFLICT (id) DO NOTHING RETURNING id`
	complete := `UPDATE bench_plain SET state = 2, status = 201, body = $2, updated_at = $3 WHERE id = $1 AND owner = $4 AND state = 1`
	// The hand-written statements are prepared as the Store's are: once on
	// SQLite, which otherwise parses them on every call; pgx caches its own
	// on PostgreSQL.
	claimRow := func(args ...any) *sql.Row { return db.QueryRowContext(b.Context(), claim, args...) }
	completeExec := func(args ...any) (sql.Result, error) { return db.ExecContext(b.Context(), complete, args...) }
	if d == sqlstore.SQLite {
		claimStmt, err := db.Prepare(strings.ReplaceAll(claim, "$", "?"))
		require.NoError(b, err)
		completeStmt, err := db.Prepare(strings.ReplaceAll(complete, "$", "?"))
		require.NoError(b, err)
		b.Cleanup(func() { _, _ = claimStmt.Close(), completeStmt.Close() })
		claimRow = func(args ...any) *sql.Row { return claimStmt.QueryRowContext(b.Context(), args...) }
		completeExec = func(args ...any) (sql.Result, error) { return completeStmt.ExecContext(b.Context(), args...) }
	}

	variants := []benchVariant{
		{"middleware", func(b *testing.B) {
			req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", key())
			rec := httptest.NewRecorder()
			mw.ServeHTTP(rec, req)
			if rec.Code != http.StatusCreated {
				b.Errorf("status %d: %s", rec.Code, rec.Body)
			}
		}},
		{"store", func(b *testing.B) {
			now := time.Now()
			c := idempotency.Claim{
				Scope:       idempotency.Scope{Principal: "bench", Method: http.MethodPost, Route: "/payments", Key: key()},
				Fingerprint: "fp", FingerprintVersion: 1, Owner: "owner-" + run, Request: []byte(reqBody),
				Now: now, LeaseFor: 30 * time.Second, ReplayWindow: 24 * time.Hour,
			}
			rec, won, err := claimed(s.Claim(b.Context(), c))
			if err != nil || !won {
				b.Errorf("claim: %v %v", won, err)
				return
			}
			if err := s.Complete(b.Context(), rec.Lease(), idempotency.Response{
				Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: respBody,
			}, time.Now()); err != nil {
				b.Error(err)
			}
		}},
		{"handwritten", func(b *testing.B) {
			id, owner, now := key(), "owner-"+run, time.Now().UnixNano()
			var got string
			if err := claimRow(id, owner, now+int64(30*time.Second), now).Scan(&got); err != nil {
				b.Error(err)
				return
			}
			res, err := completeExec(id, respBody, time.Now().UnixNano(), owner)
			if err != nil {
				b.Error(err)
				return
			}
			if n, _ := res.RowsAffected(); n != 1 {
				b.Errorf("update changed %d rows", n)
			}
		}},
	}
	for _, conc := range []int{1, 16} {
		b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { interleave(b, conc, variants) })
	}
}

// benchBatch is how many requests each variant runs per round of
// interleave: enough for 16 callers to overlap, short enough (tens of
// milliseconds) for the rounds to follow the machine's drift.
const benchBatch = 64

// interleave runs b.N requests of each variant from conc goroutines, in
// rounds of benchBatch requests per variant whose order rotates each round,
// and reports each variant's ns and allocations per request and, as
// <variant>-ratio, the last variant's time (the baseline) over each other
// variant's. The benchmark's own ns/op is the variants' sum.
func interleave(b *testing.B, conc int, variants []benchVariant) {
	spent := make([]time.Duration, len(variants))
	allocs := make([]uint64, len(variants))
	var ms runtime.MemStats
	b.ResetTimer()
	for round, done := 0, 0; done < b.N; round++ {
		n := min(benchBatch, b.N-done)
		for i := range variants {
			j := (i + round) % len(variants)
			runtime.ReadMemStats(&ms)
			before, start := ms.Mallocs, time.Now()
			parallel(n, conc, func() { variants[j].op(b) })
			spent[j] += time.Since(start)
			runtime.ReadMemStats(&ms)
			allocs[j] += ms.Mallocs - before
		}
		done += n
	}
	b.StopTimer()
	last := len(variants) - 1
	for i, v := range variants {
		b.ReportMetric(float64(spent[i].Nanoseconds())/float64(b.N), v.name+"-ns/op")
		b.ReportMetric(float64(allocs[i])/float64(b.N), v.name+"-allocs/op")
		if i != last {
			b.ReportMetric(float64(spent[last])/float64(spent[i]), v.name+"-ratio")
		}
	}
}

// benchVariant is one way of serving a request with a new key.
type benchVariant struct {
	name string
	op   func(b *testing.B)
}

// parallel runs op n times in total from conc goroutines.
func parallel(n, conc int, op func()) {
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

// BenchmarkReplay measures on each dialect the replay of a completed record
// with a 64-byte and a 1 MiB body, at 1 and 16 callers: claim (Store.Claim,
// which finds the record and writes nothing) against get (Store.Get, the
// plain read of the record), interleaved; claim-ratio is get's time over
// claim's (the goal: a replay at most 2x a Get, a ratio of 0.5 or more).
//
//	SAFERETRY_PG_DSN=... go test -run '^$' -bench 'BenchmarkReplay$' -benchtime 2000x ./idempotency/sqlstore/
func BenchmarkReplay(b *testing.B) {
	for _, be := range backends {
		for _, size := range []int{64, 1 << 20} {
			b.Run(fmt.Sprintf("%s/body=%d", be.name, size), func(b *testing.B) {
				s, db := newStore(b, be)
				db.SetMaxIdleConns(20) // as many as it may open: no connection is made per call
				sc := idempotency.Scope{Principal: "bench", Method: http.MethodPost, Route: "/files", Key: "k"}
				res, err := s.Claim(b.Context(), idempotency.Claim{Scope: sc, Fingerprint: "fp", FingerprintVersion: 1,
					Owner: "A", Now: time.Now(), LeaseFor: time.Minute, ReplayWindow: time.Hour})
				require.NoError(b, err)
				body := []byte(strings.Repeat("0123456789abcdef", size/16))
				require.NoError(b, s.Complete(b.Context(), res.Record.Lease(),
					idempotency.Response{Status: 200, Body: body}, time.Now()))
				for _, conc := range []int{1, 16} {
					b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) {
						interleave(b, conc, []benchVariant{
							{"claim", func(b *testing.B) {
								res, err := s.Claim(b.Context(), idempotency.Claim{Scope: sc, Fingerprint: "fp",
									FingerprintVersion: 1, Owner: "B", Now: time.Now(), LeaseFor: time.Minute,
									ReplayWindow: time.Hour})
								if err != nil || res.Outcome != idempotency.ClaimExisting ||
									len(res.Record.Response.Body) != len(body) {
									b.Errorf("replay: %v %v", res.Outcome, err)
								}
							}},
							{"get", func(b *testing.B) {
								if rec, err := s.Get(b.Context(), sc); err != nil || len(rec.Response.Body) != len(body) {
									b.Errorf("get: %v", err)
								}
							}},
						})
					})
				}
			})
		}
	}
}
