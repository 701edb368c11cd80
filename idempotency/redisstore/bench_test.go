package redisstore_test

import (
	"context"
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

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// handClaim and handComplete are the smallest Redis claim and completion
// that could replace the Store's: one hash per key, one script each, no
// index, no fence beyond the owner, no scope check. The claim creates the
// record or answers the existing one (state, owner, body) in one round
// trip; the completion stores the response if the caller still owns it.
var (
	handClaim = redis.NewScript(`
local f = redis.call('HMGET', KEYS[1], 'st', 'o', 'rb')
if f[1] then return {0, f[1], f[2], f[3]} end
redis.call('HSET', KEYS[1], 'st', '1', 'o', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1}
`)
	handComplete = redis.NewScript(`
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', '2', 'rs', ARGV[2], 'rb', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
`)
)

// BenchmarkRedis compares, on the same Redis in the same run, at 1 and 16
// concurrent callers:
//
//   - fresh: a guarded request with a new key (httptest recorder, no
//     network; the handler writes nothing), the Store's own Claim and
//     Complete for it, and the hand-written claim and completion above
//     (two round trips each);
//   - replay: a request whose key completed, through the middleware
//     against the hand-written claim answering the stored body (one round
//     trip each);
//   - conflict: a request whose key is in progress (409), likewise.
//
// Each sub-benchmark runs its variants interleaved: rounds of 64 requests
// per variant, the order rotating each round, so that a shared machine's
// drift falls on all alike. It reports each variant's time and allocations
// per request and, as <variant>-ratio, the hand-written time over the
// variant's (1.0: as fast as the hand-written loop). The times are wall
// time over requests, the callers running at once: requests per second are
// 1e9 / ns per request. Run (repeat with -count to see the spread):
//
//	SAFERETRY_REDIS_ADDR=127.0.0.1:6379 go test -run '^$' -bench 'BenchmarkRedis$' -benchtime 3000x ./idempotency/redisstore/
func BenchmarkRedis(b *testing.B) {
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(b), ContextTimeoutEnabled: true, PoolSize: 32})
	b.Cleanup(func() { _ = rdb.Close() })
	prefix := freshPrefix(b, rdb)
	s := openStore(b, rdb, redisstore.WithPrefix(prefix))
	ctx := b.Context()

	const reqBody = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
	respBody := []byte(`{"id":"pay_1","status":"succeeded"}`)
	key := func() string { return "bench-" + randHex(16) }
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(respBody)
	})
	inProgress := make(chan struct{})
	var holding sync.WaitGroup
	b.Cleanup(func() {
		close(inProgress)
		holding.Wait()
	})
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-inProgress })
	opts := []idempotency.Option{
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
	}
	mw := idempotency.New(s, opts...)
	fresh, held := mw.Wrap(ok), mw.Wrap(slow)
	serve := func(b *testing.B, h http.Handler, k string, want int) {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", k)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != want {
			b.Errorf("status %d, want %d: %s", rec.Code, want, rec.Body)
		}
	}
	handKey := func(k string) []string { return []string{prefix + "hand:" + k} }
	hand := func(b *testing.B, k string, want int64) []any {
		v, err := handClaim.Run(ctx, rdb, handKey(k), "owner-"+k, 30000).Slice()
		if err != nil || v[0].(int64) != want {
			b.Errorf("hand claim: %v %v", v, err)
		}
		return v
	}

	// The replayed and the in-progress keys, for each kind of loop.
	serve(b, fresh, "done", http.StatusCreated)
	holding.Go(func() { // never answers: its handler blocks until cleanup
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "held")
		held.ServeHTTP(httptest.NewRecorder(), req)
	})
	hand(b, "done", 1)
	require.NoError(b, handComplete.Run(ctx, rdb, handKey("done"), "owner-done", 201, respBody, 86400000).Err())
	hand(b, "held", 1)
	for {
		if rec, err := s.Get(ctx, idempotency.Scope{Principal: "bench", Method: http.MethodPost,
			Route: "/payments", Key: "held"}); err == nil && rec.State == idempotency.InProgress {
			break
		}
		time.Sleep(time.Millisecond)
	}

	cases := []struct {
		name     string
		variants []benchVariant
	}{
		{"fresh", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, fresh, key(), http.StatusCreated) }},
			{"store", func(b *testing.B) {
				now := time.Now()
				res, err := s.Claim(ctx, idempotency.Claim{
					Scope:       idempotency.Scope{Principal: "bench", Method: http.MethodPost, Route: "/payments", Key: key()},
					Fingerprint: "fp", FingerprintVersion: 1, Owner: "owner", Request: []byte(reqBody),
					Now: now, LeaseFor: 30 * time.Second, ReplayWindow: 24 * time.Hour,
				})
				if err != nil || !res.Acquired() {
					b.Errorf("claim: %v %v", res.Outcome, err)
					return
				}
				if err := s.Complete(ctx, res.Record.Lease(), idempotency.Response{Status: 201,
					Header: http.Header{"Content-Type": {"application/json"}}, Body: respBody}, time.Now()); err != nil {
					b.Error(err)
				}
			}},
			{"handwritten", func(b *testing.B) {
				k := key()
				hand(b, k, 1)
				if n, err := handComplete.Run(ctx, rdb, handKey(k), "owner-"+k, 201, respBody, 86400000).Int64(); err != nil || n != 1 {
					b.Errorf("hand complete: %d %v", n, err)
				}
			}},
		}},
		{"replay", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, fresh, "done", http.StatusCreated) }},
			{"handwritten", func(b *testing.B) { hand(b, "done", 0) }},
		}},
		{"conflict", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, fresh, "held", http.StatusConflict) }},
			{"handwritten", func(b *testing.B) { hand(b, "held", 0) }},
		}},
	}
	for _, tc := range cases {
		for _, conc := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/c%d", tc.name, conc), func(b *testing.B) { interleave(b, conc, tc.variants) })
		}
	}
}

// interleave runs b.N requests of each variant from conc goroutines, in
// rounds of 64 requests per variant whose order rotates each round, and
// reports each variant's ns and allocations per request and, as
// <variant>-ratio, the last variant's time (the baseline) over each other
// variant's.
func interleave(b *testing.B, conc int, variants []benchVariant) {
	const batch = 64
	spent := make([]time.Duration, len(variants))
	allocs := make([]uint64, len(variants))
	var ms runtime.MemStats
	b.ResetTimer()
	for round, done := 0, 0; done < b.N; round++ {
		n := min(batch, b.N-done)
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

// benchVariant is one way of serving a request.
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

// BenchmarkClaimGuard measures what the marker check costs a claim, on the
// same Redis in the same run, interleaved (see interleave), at 1 and 16
// callers: a claim of a new key, the only claim that reads its shard's
// marker (inside its script: no round trip of its own), through the Store
// and through the same script without the check (ClaimUnguarded, the
// baseline). guarded-ratio is the baseline's time over the Store's: the
// Store's throughput as a share of the unguarded one's. Run:
//
//	SAFERETRY_REDIS_ADDR=127.0.0.1:6379 go test -run '^$' -bench 'BenchmarkClaimGuard$' -benchtime 20000x -count 4 ./idempotency/redisstore/
func BenchmarkClaimGuard(b *testing.B) {
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(b), ContextTimeoutEnabled: true, PoolSize: 32})
	b.Cleanup(func() { _ = rdb.Close() })
	s := openStore(b, rdb, redisstore.WithPrefix(freshPrefix(b, rdb)))
	ctx := b.Context()
	claim := func(b *testing.B, f func(context.Context, *redisstore.Store, idempotency.Claim) (
		idempotency.ClaimResult, error)) {
		c := testClaim("bench-"+randHex(16), "owner", time.Now())
		c.Request = []byte(`{"amount":4200,"currency":"eur","customer":"cus_1"}`)
		res, err := f(ctx, s, c)
		if err != nil || res.Outcome != idempotency.ClaimCreated {
			b.Errorf("claim: %v %v", res.Outcome, err)
		}
	}
	variants := []benchVariant{
		{"guarded", func(b *testing.B) {
			claim(b, func(ctx context.Context, s *redisstore.Store, c idempotency.Claim) (
				idempotency.ClaimResult, error) {
				return s.Claim(ctx, c)
			})
		}},
		{"unguarded", func(b *testing.B) { claim(b, redisstore.ClaimUnguarded) }},
	}
	for _, conc := range []int{1, 16} {
		b.Run(fmt.Sprintf("new/c%d", conc), func(b *testing.B) { interleave(b, conc, variants) })
	}
}
