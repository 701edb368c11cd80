package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
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

// logBuffer is a log destination that tests read while the Store writes.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func (b *logBuffer) logger() redisstore.Option {
	return redisstore.WithLogger(slog.New(slog.NewTextHandler(b, nil)))
}

// eventually calls f every 20 ms until it returns true, for at most 20 s.
func eventually(t *testing.T, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !f() {
		require.True(t, time.Now().Before(deadline), "never: %s", what)
		time.Sleep(20 * time.Millisecond)
	}
}

// markers returns the 256 markers of prefix, read on the server at addr.
func markers(t *testing.T, rdb *redis.Client, prefix string) []string {
	t.Helper()
	out := make([]string, 256)
	for i := range out {
		v, err := rdb.Get(t.Context(), prefix+"{"+hexByte(i)+"}marker").Result()
		if err != redis.Nil {
			require.NoError(t, err)
		}
		out[i] = v
	}
	return out
}

func hexByte(i int) string { return strconv.FormatInt(int64(0x100+i), 16)[1:] }

// allQuarantined reports whether every marker is a quarantine's.
func allQuarantined(marks []string) bool {
	for _, m := range marks {
		if !strings.HasPrefix(m, "q") {
			return false
		}
	}
	return true
}

// requireForgotten checks err is a claim's refusal for a shard that may
// have forgotten, and returns the time of the detection.
func requireForgotten(t *testing.T, err error) time.Time {
	t.Helper()
	require.ErrorIs(t, err, redisstore.ErrForgotten)
	require.NotErrorIs(t, err, idempotency.ErrStoreFull, "503 store_unavailable, not store_full")
	var oe *redisstore.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "claim", oe.Op)
	var fe *redisstore.ForgottenError
	require.ErrorAs(t, err, &fe)
	return fe.Since
}

// TestRestartForgets restarts a Redis of the test's own that keeps nothing
// on disk, while a key is completed and another in progress. Claims of
// either are refused (their records are gone), and of a new key too, with
// the time the loss was detected; the live owner's writes fail with
// ErrLeaseLost; a read finds nothing. The shards quarantine within a check,
// also for a Store opened afterwards (another server starting). The
// quarantine ends for a claim once its replay window and margin have
// passed since the detection, or for every claim with Rearm.
func TestRestartForgets(t *testing.T) {
	r := runRedis(t)
	rdb := clientOf(t, r.addr)
	var logs logBuffer
	s := openStore(t, rdb, logs.logger())
	ctx := t.Context()
	now := time.Now()
	done, err := s.Claim(ctx, testClaim("done", "a", now))
	require.NoError(t, err)
	require.NoError(t, s.Complete(ctx, done.Record.Lease(), okResponse, now))
	running, err := s.Claim(ctx, testClaim("running", "a", now))
	require.NoError(t, err)
	l := running.Record.Lease()

	r.kill()
	r.start()

	later := now.Add(time.Second)
	_, err = s.Claim(ctx, testClaim("done", "b", later))
	since := requireForgotten(t, err)
	require.True(t, since.Equal(later), "detected by this claim, at its time")
	_, err = s.Claim(ctx, testClaim("running", "b", later.Add(time.Hour)))
	requireForgotten(t, err)
	_, err = s.Claim(ctx, testClaim("new", "b", later))
	requireForgotten(t, err)
	takeover := testClaim("running", "b", later.Add(time.Hour))
	takeover.TakeoverOnly = true
	res, err := s.Claim(ctx, takeover)
	require.NoError(t, err, "nothing to take over is no creation")
	require.False(t, res.Acquired())

	require.ErrorIs(t, s.Heartbeat(ctx, l, later.Add(time.Minute)), idempotency.ErrLeaseLost)
	require.ErrorIs(t, s.SetRecoveryPoint(ctx, l, "charged", []byte("ch_1"), later), idempotency.ErrLeaseLost)
	require.ErrorIs(t, s.Complete(ctx, l, okResponse, later), idempotency.ErrLeaseLost)
	require.ErrorIs(t, s.Release(ctx, l), idempotency.ErrLeaseLost)
	_, err = s.Get(ctx, testScope("done"))
	require.ErrorIs(t, err, idempotency.ErrNotFound, "Get reads what Redis holds")

	eventually(t, "every shard quarantined by the check the claim started", func() bool {
		return allQuarantined(markers(t, rdb, redisstore.DefaultPrefix))
	})
	require.Contains(t, logs.String(), "a claim found its shard without its marker")
	require.Contains(t, logs.String(), "Redis lost records")
	require.Empty(t, keysLike(t, rdb, redisstore.DefaultPrefix, "{*}r:*"), "no record created")

	s2 := openStore(t, clientOf(t, r.addr))
	_, err = s2.Claim(ctx, testClaim("done", "c", later))
	requireForgotten(t, err)

	keep := 24*time.Hour + time.Minute // testClaim's window, and its margin: a minute
	_, err = s2.Claim(ctx, testClaim("done", "c", since.Add(keep)))
	requireForgotten(t, err)
	longer := testClaim("done", "c", since.Add(keep+time.Nanosecond))
	longer.ReplayWindow = 48 * time.Hour
	_, err = s2.Claim(ctx, longer)
	requireForgotten(t, err) // its own window is not over
	res, err = s2.Claim(ctx, testClaim("done", "c", since.Add(keep+time.Nanosecond)))
	require.NoError(t, err, "the window and the margin passed since the detection")
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)

	require.NoError(t, s.Rearm(ctx))
	require.Contains(t, logs.String(), "re-armed by the operator")
	for _, st := range []*redisstore.Store{s, s2} {
		res, err = st.Claim(ctx, testClaim("new-"+randHex(4), "d", later))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	}
}

// TestRestartForgetsOverHTTP runs the middleware over a Redis of the
// test's own that restarts without persistence while three keys are
// completed and one runs: every retry is answered 503
// idempotency_store_unavailable, no key runs twice, and the running
// handler is stopped (its lease lost) instead of running beside a second
// execution, until the operator re-arms the store.
func TestRestartForgetsOverHTTP(t *testing.T) {
	r := runRedis(t)
	s := openStore(t, clientOf(t, r.addr))
	var mu sync.Mutex
	runs := map[string]int{}
	entered := make(chan struct{})
	cause := make(chan error, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		runs[key]++
		mu.Unlock()
		if key == "running" {
			close(entered)
			<-r.Context().Done()
			cause <- context.Cause(r.Context())
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_`+key+`"}`)
	})
	mw := idempotency.New(s, idempotency.WithLease(900*time.Millisecond),
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil }))
	srv := httptest.NewServer(mw.Wrap(h))
	t.Cleanup(srv.Close)
	post := func(key string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":1}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, problemCode(string(body))
	}
	keys := []string{"k0", "k1", "k2"}
	for _, k := range keys {
		status, _ := post(k)
		require.Equal(t, http.StatusCreated, status)
	}
	first := make(chan int, 1)
	go func() {
		status, _ := post("running")
		first <- status
	}()
	<-entered

	r.kill()
	r.start()

	for _, k := range append(keys, "running", "fresh") {
		status, code := post(k)
		require.Equal(t, http.StatusServiceUnavailable, status, k)
		require.Equal(t, string(idempotency.CodeStoreUnavailable), code, k)
	}
	select {
	case err := <-cause:
		require.ErrorIs(t, err, idempotency.ErrLeaseLost, "the live owner lost its lease")
	case <-time.After(20 * time.Second):
		t.Fatal("the running handler was never stopped")
	}
	<-first
	status, _ := post("running")
	require.Equal(t, http.StatusServiceUnavailable, status)
	mu.Lock()
	require.Equal(t, map[string]int{"k0": 1, "k1": 1, "k2": 1, "running": 1}, runs, "no key ran twice")
	mu.Unlock()

	require.NoError(t, s.Rearm(t.Context()))
	status, _ = post("fresh")
	require.Equal(t, http.StatusCreated, status, "re-armed: new keys run")
}

// TestFlushedThenArmedByAnotherNew empties a Redis of the test's own
// (FLUSHALL) and opens another Store on it, as a server starting then
// would: New finds no marker and arms the prefix under an epoch of its
// own. The first Store's next claim finds that epoch, not its own, and the
// check it starts quarantines every shard, so the second Store refuses
// too.
func TestFlushedThenArmedByAnotherNew(t *testing.T) {
	addr := startRedis(t)
	rdb := clientOf(t, addr)
	s1 := openStore(t, rdb)
	ctx := t.Context()
	now := time.Now()
	done, err := s1.Claim(ctx, testClaim("done", "a", now))
	require.NoError(t, err)
	require.NoError(t, s1.Complete(ctx, done.Record.Lease(), okResponse, now))

	require.NoError(t, rdb.FlushAll(ctx).Err())
	var logs logBuffer
	s2 := openStore(t, clientOf(t, addr), logs.logger())
	require.Contains(t, logs.String(), "arming a new prefix")

	_, err = s1.Claim(ctx, testClaim("done", "b", now))
	requireForgotten(t, err)
	eventually(t, "every shard quarantined", func() bool {
		return allQuarantined(markers(t, rdb, redisstore.DefaultPrefix))
	})
	_, err = s2.Claim(ctx, testClaim("done", "c", now))
	requireForgotten(t, err)
}

// TestConcurrentNewsArmOnce opens Stores on a new prefix at once, as a
// fleet starting does: they arm it under one epoch, and none of them finds
// a shard forgotten.
func TestConcurrentNewsArmOnce(t *testing.T) {
	addr := startRedis(t)
	const n = 6
	stores := make([]*redisstore.Store, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = rdb.Close() })
			s, err := redisstore.New(rdb, redisstore.WithMemoryOnly(true))
			if err == nil {
				t.Cleanup(func() { _ = s.Close() })
			}
			require.NoError(t, err)
			stores[i] = s
		})
	}
	wg.Wait()
	marks := markers(t, clientOf(t, addr), redisstore.DefaultPrefix)
	require.True(t, strings.HasPrefix(marks[0], "n"), marks[0])
	for _, m := range marks {
		require.Equal(t, marks[0], m, "one epoch on every shard")
	}
	for i, s := range stores {
		res, err := s.Claim(t.Context(), testClaim("k-"+strconv.Itoa(i), "a", time.Now()))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	}
}

// TestEvictionSwitchedOn switches a Redis of the test's own to
// allkeys-lru after New, then fills it until it evicted the completed
// records. Within a check, claims of new keys are refused (replays still
// answered); once Redis evicted keys every shard is quarantined, so that
// switching back to noeviction does not bring a lost record's request
// back: no completed key runs again until the operator re-arms.
func TestEvictionSwitchedOn(t *testing.T) {
	addr := startRedis(t, "--maxmemory-policy", "noeviction")
	rdb := clientOf(t, addr)
	var logs logBuffer
	s := openStore(t, rdb, logs.logger(), redisstore.WithCheckInterval(20*time.Millisecond))
	ctx := t.Context()
	now := time.Now()
	keys := []string{"k0", "k1", "k2", "k3"}
	for _, k := range keys {
		res, err := s.Claim(ctx, testClaim(k, "a", now))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, res.Record.Lease(), okResponse, now))
	}

	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err())
	eventually(t, "claims of new keys refused", func() bool {
		_, err := s.Claim(ctx, testClaim("new-"+randHex(4), "a", now))
		return errors.Is(err, redisstore.ErrEvictionPolicy)
	})
	var pe *redisstore.EvictionPolicyError
	_, err := s.Claim(ctx, testClaim("new", "a", now))
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "allkeys-lru", pe.Policy)
	for _, k := range keys {
		res, err := s.Claim(ctx, testClaim(k, "b", now))
		require.NoError(t, err, "a replay reads a record Redis holds")
		require.Equal(t, idempotency.Completed, res.Record.State)
	}
	require.Contains(t, logs.String(), "a server may evict keys")

	limit := usedMemory(t, rdb.Info(ctx, "memory").Val()) + 256<<10
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", strconv.FormatInt(limit, 10)).Err())
	filler := bytes.Repeat([]byte("f"), 8<<10)
	for i := 0; len(keysLike(t, rdb, redisstore.DefaultPrefix, "{*}r:*")) > 0; i++ {
		require.Less(t, i, 5000, "Redis never evicted the records")
		require.NoError(t, rdb.Set(ctx, "filler:"+strconv.Itoa(i), filler, 0).Err())
	}
	for _, k := range keys {
		_, err := s.Claim(ctx, testClaim(k, "c", now))
		require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, "evicted: not created again")
	}

	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", "0").Err())
	eventually(t, "the check notices noeviction", func() bool {
		_, err := s.Claim(ctx, testClaim("k0", "d", now))
		return !errors.Is(err, redisstore.ErrEvictionPolicy)
	})
	for _, k := range keys {
		_, err := s.Claim(ctx, testClaim(k, "d", now))
		requireForgotten(t, err)
	}
	require.Contains(t, logs.String(), "a server evicted keys")

	require.NoError(t, s.Rearm(ctx))
	res, err := s.Claim(ctx, testClaim("after", "e", now))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
}

// usedMemory reads used_memory from INFO memory.
func usedMemory(t *testing.T, info string) int64 {
	t.Helper()
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
			return n
		}
	}
	t.Fatal("no used_memory in INFO memory")
	return 0
}

// TestPersistence runs Redis servers of the test's own: New refuses one
// that keeps nothing on disk unless WithMemoryOnly, accepts one with AOF
// or an RDB save point, and a check logs a server that stops persisting.
func TestPersistence(t *testing.T) {
	addr := startRedis(t)
	_, err := redisstore.New(clientOf(t, addr))
	require.ErrorIs(t, err, redisstore.ErrNoPersistence)
	var pe *redisstore.PersistenceError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, addr, pe.Addr)
	openStore(t, clientOf(t, addr)) // WithMemoryOnly(true)

	saving, err := redisstore.New(clientOf(t, startRedis(t, "--save", "3600 1")))
	require.NoError(t, err)
	require.NoError(t, saving.Close())

	rdb := clientOf(t, startRedis(t, "--appendonly", "yes"))
	var logs logBuffer
	s, err := redisstore.New(rdb, logs.logger(), redisstore.WithCheckInterval(20*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.NoError(t, rdb.ConfigSet(t.Context(), "appendonly", "no").Err())
	eventually(t, "the check logs it", func() bool {
		return strings.Contains(logs.String(), "keeps nothing on disk")
	})
	_, err = s.Claim(t.Context(), testClaim("k", "a", time.Now()))
	require.NoError(t, err, "logged, not refused: a restart would be detected")
}

// TestCloseEndsACheck closes a Store while its check waits for a Redis
// that answers 30 s late: Close returns within the check's deadline (the
// Store's WithTimeout, 300 ms here), a second Close at once, and no
// goroutine is left (TestMain's goleak).
func TestCloseEndsACheck(t *testing.T) {
	p := newFaultProxy(t, startRedis(t))
	rdb := redis.NewClient(&redis.Options{Addr: p.addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	s, err := redisstore.New(rdb, redisstore.WithMemoryOnly(true),
		redisstore.WithCheckInterval(time.Millisecond), redisstore.WithTimeout(300*time.Millisecond))
	require.NoError(t, err)
	p.setLatency(30 * time.Second)
	time.Sleep(50 * time.Millisecond) // a check is under way, waiting
	start := time.Now()
	require.NoError(t, s.Close())
	require.Less(t, time.Since(start), 3*time.Second, "Close waited past the check's deadline")
	require.NoError(t, s.Close())
}
