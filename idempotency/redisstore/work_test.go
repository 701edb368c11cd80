package redisstore_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// BenchmarkRedisWork measures what the Store asks of Redis itself, on a
// Redis of its own (so that no other client's commands are counted), for
// the middleware's requests (a new key's claim and completion, a replay's
// claim, an in-progress conflict's claim) against the hand-written claim
// and completion of BenchmarkRedis, interleaved in rounds of 64 requests:
//
//   - <script>-us: the median Redis time of each script, from SLOWLOG
//     (every command logged);
//   - <phase>-cpu-us: the CPU time of Redis's main thread per request
//     (INFO cpu), network included;
//   - record-bytes, record-1k-bytes: the memory of a completed record
//     (MEMORY USAGE) with a small JSON body and with one of 1 KiB, against
//     hand-record-bytes and hand-record-1k-bytes for the hand-written one,
//     and index-bytes/record, its share of its shard's done index.
//
// ns/op is the whole loop's and means little. Run:
//
//	go test -run '^$' -bench 'BenchmarkRedisWork$' -benchtime 2000x ./idempotency/redisstore/
func BenchmarkRedisWork(b *testing.B) {
	addr := startRedis(b, "--slowlog-log-slower-than", "0", "--slowlog-max-len", "1000")
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	b.Cleanup(func() { _ = rdb.Close() })
	ctx := b.Context()
	const prefix = "work:"
	s := openStore(b, rdb, redisstore.WithPrefix(prefix))

	const reqBody = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
	respBody := []byte(`{"id":"pay_1","status":"succeeded"}`)
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(respBody)
	})
	release := make(chan struct{})
	var holding sync.WaitGroup
	b.Cleanup(func() {
		close(release)
		holding.Wait()
	})
	mw := idempotency.New(s,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	fresh := mw.Wrap(ok)
	held := mw.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-release }))
	serve := func(h http.Handler, key string, want int) {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != want {
			b.Fatalf("status %d, want %d: %s", rec.Code, want, rec.Body)
		}
	}
	scope := func(key string) idempotency.Scope {
		return idempotency.Scope{Principal: "bench", Method: http.MethodPost, Route: "/payments",
			Key: key}
	}
	serve(fresh, "done", http.StatusCreated)
	holding.Go(func() { // answers at cleanup
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "held")
		held.ServeHTTP(httptest.NewRecorder(), req)
	})
	for {
		rec, err := s.Get(ctx, scope("held"))
		if err == nil && rec.State == idempotency.InProgress {
			break
		}
		time.Sleep(time.Millisecond)
	}
	hand := func(k string) []string { return []string{prefix + "hand:" + k} }
	handFresh := func(k string) {
		require.NoError(b, handClaim.Run(ctx, rdb, hand(k), "owner-"+k, 30000).Err())
		err := handComplete.Run(ctx, rdb, hand(k), "owner-"+k, 201, respBody, 86400000).Err()
		require.NoError(b, err)
	}
	handFresh("done")
	require.NoError(b, handClaim.Run(ctx, rdb, hand("held"), "owner-held", 30000).Err())

	// The scripts, by SHA1, as SLOWLOG shows them.
	names := map[string]string{}
	hands := map[string]*redis.Script{"hand-claim": handClaim, "hand-complete": handComplete}
	for name, sc := range hands {
		names[sc.Hash()] = name
	}
	names[scriptHash(b, rdb, s, prefix)] = "claim"
	// The phases run interleaved, 64 requests each per round in an order
	// that rotates, so that a shared machine's drift falls on all alike.
	phases := []workPhase{
		{"fresh", map[string]string{"": "complete"}, func() {
			serve(fresh, "fresh-"+randHex(8), http.StatusCreated)
		}},
		{"replay", map[string]string{"claim": "replay"}, func() { serve(fresh, "done", http.StatusCreated) }},
		{"conflict", map[string]string{"claim": "conflict"}, func() {
			serve(fresh, "held", http.StatusConflict)
		}},
		{"hand", nil, func() { handFresh(randHex(8)) }},
		{"hand-replay", map[string]string{"hand-claim": "hand-replay"}, func() {
			require.NoError(b, handClaim.Run(ctx, rdb, hand("done"), "x", 30000).Err())
		}},
	}
	times := map[string][]time.Duration{}
	cpu := make([]time.Duration, len(phases))
	b.ResetTimer()
	for round, done := 0, 0; done < b.N; round++ {
		n := min(64, b.N-done)
		for i := range phases {
			ph := phases[(i+round)%len(phases)]
			require.NoError(b, rdb.SlowLogReset(ctx).Err())
			before := redisCPU(b, rdb)
			for range n {
				ph.run()
			}
			cpu[(i+round)%len(phases)] += redisCPU(b, rdb) - before
			scriptTimes(b, rdb, names, ph, times)
		}
		done += n
	}
	b.StopTimer()
	for i, ph := range phases {
		b.ReportMetric(cpu[i].Seconds()*1e6/float64(b.N), ph.name+"-cpu-us")
	}
	for name, ds := range times {
		slices.Sort(ds)
		b.ReportMetric(float64(ds[len(ds)/2].Nanoseconds())/1e3, name+"-us")
	}

	// Memory: a completed record of its own (the one record under a
	// prefix of its own), and the done index's usage per member after
	// the fresh requests.
	ms := openStore(b, rdb, redisstore.WithPrefix("mem:"))
	serve(idempotency.New(ms,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))).Wrap(ok),
		"memory", http.StatusCreated)
	recs := rdb.Keys(ctx, "mem:{*}r:*").Val()
	require.Len(b, recs, 1)
	b.ReportMetric(float64(rdb.MemoryUsage(ctx, recs[0], 0).Val()), "record-bytes")
	// And with a body of 1 KiB, over Redis's compact encoding's 64 bytes.
	big := []byte(`{"id":"pay_1","note":"` + strings.Repeat("x", 1000) + `"}`)
	require.NoError(b, rdb.Del(ctx, recs[0]).Err())
	serve(idempotency.New(ms,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))).Wrap(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(big)
		})), "memory-1k", http.StatusCreated)
	recs = rdb.Keys(ctx, "mem:{*}r:*").Val()
	require.Len(b, recs, 1)
	b.ReportMetric(float64(rdb.MemoryUsage(ctx, recs[0], 0).Val()), "record-1k-bytes")
	require.NoError(b, handClaim.Run(ctx, rdb, hand("big"), "owner-big", 30000).Err())
	err := handComplete.Run(ctx, rdb, hand("big"), "owner-big", 201, big, 86400000).Err()
	require.NoError(b, err)
	b.ReportMetric(float64(rdb.MemoryUsage(ctx, hand("big")[0], 0).Val()), "hand-record-1k-bytes")
	var indexBytes, members int64
	for _, k := range rdb.Keys(ctx, prefix+"{*}done").Val() {
		indexBytes += rdb.MemoryUsage(ctx, k, 0).Val()
		members += rdb.ZCard(ctx, k).Val()
	}
	if members > 0 {
		b.ReportMetric(float64(indexBytes)/float64(members), "index-bytes/record")
	}
	b.ReportMetric(float64(rdb.MemoryUsage(ctx, hand("done")[0], 0).Val()), "hand-record-bytes")
}

// workPhase is one kind of request BenchmarkRedisWork measures; rename
// names its scripts (see scriptTimes).
type workPhase struct {
	name   string
	rename map[string]string
	run    func()
}

// scriptTimes adds to times the Redis time of each script SLOWLOG logged
// since its reset, named by names (by SHA1) and then by ph.rename; a
// script names cannot name is ph.rename[""]. The benchmark reports the
// median: the mean, on a shared machine, is mostly the moments the Redis
// process waited for a core.
func scriptTimes(b *testing.B, rdb *redis.Client, names map[string]string, ph workPhase,
	times map[string][]time.Duration) {
	logs, err := rdb.SlowLogGet(b.Context(), -1).Result()
	require.NoError(b, err)
	for _, l := range logs {
		if len(l.Args) < 2 || !strings.EqualFold(l.Args[0], "evalsha") {
			continue
		}
		name := names[l.Args[1]]
		if r, ok := ph.rename[name]; ok {
			name = r
		}
		if name == "" {
			b.Fatalf("%s: a script of unknown SHA1 %s ran", ph.name, l.Args[1])
		}
		times[name] = append(times[name], l.Duration)
	}
}

// redisCPU returns the CPU time Redis's main thread has used (INFO cpu):
// what it spent on a phase's requests, network included, and not the time
// it waited for a core.
func redisCPU(b *testing.B, rdb *redis.Client) time.Duration {
	info, err := rdb.Info(b.Context(), "cpu").Result()
	require.NoError(b, err)
	var sum float64
	for _, line := range strings.Split(info, "\r\n") {
		for _, f := range []string{"used_cpu_user_main_thread:", "used_cpu_sys_main_thread:"} {
			if v, ok := strings.CutPrefix(line, f); ok {
				n, err := strconv.ParseFloat(v, 64)
				require.NoError(b, err)
				sum += n
			}
		}
	}
	return time.Duration(sum * float64(time.Second))
}

// scriptHash returns the SHA1 of the Store's claim script: the script a
// Claim on a fresh key runs, found in SLOWLOG.
func scriptHash(b *testing.B, rdb *redis.Client, s *redisstore.Store, prefix string) string {
	ctx := b.Context()
	require.NoError(b, rdb.SlowLogReset(ctx).Err())
	_, err := s.Claim(ctx, idempotency.Claim{
		Scope:       idempotency.Scope{Principal: "p", Method: "POST", Route: "/", Key: randHex(8)},
		Fingerprint: "fp", FingerprintVersion: 1, Owner: "o", Now: time.Now(),
		LeaseFor:     time.Second,
		ReplayWindow: time.Hour,
	})
	require.NoError(b, err)
	for _, l := range rdb.SlowLogGet(ctx, -1).Val() {
		if len(l.Args) > 1 && strings.EqualFold(l.Args[0], "evalsha") {
			return l.Args[1]
		}
	}
	b.Fatal("the claim ran no EVALSHA")
	return ""
}
