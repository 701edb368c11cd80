package redisstore_test

import (
	"context"
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

// counter is a go-redis hook that records the commands the client sends,
// each a round trip (the Store pipelines nothing on a request's path).
type counter struct {
	mu   sync.Mutex
	cmds []string
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.mu.Lock()
		c.cmds = append(c.cmds, cmd.Name())
		c.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.mu.Lock()
		c.cmds = append(c.cmds, "pipeline")
		c.mu.Unlock()
		return next(ctx, cmds)
	}
}

func (c *counter) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.cmds
	c.cmds = nil
	return out
}

// TestRoundTrips counts what the middleware sends to Redis per guarded
// request, on a standalone Redis and on a Cluster: a new key two scripts
// (claim, completion), a replay one, an in-progress conflict one. The
// claim's marker check (see the package documentation) is inside its
// script: no command of its own.
func TestRoundTrips(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		rdb := b.client(t)
		prefix := freshPrefix(t, rdb)
		// No check of the Store's own during the count: they are not a
		// request's (see WithCheckInterval for their cost).
		s := openStore(t, rdb, redisstore.WithPrefix(prefix), redisstore.WithCheckInterval(time.Hour))
		hook := &counter{}
		rdb.AddHook(hook)
		release := make(chan struct{})
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Idempotency-Key") == "held" {
				<-release
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":"ch_1"}`))
		})
		mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil })).Wrap(h)
		serve := func(key string) int {
			req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1}`))
			req.Header.Set("Idempotency-Key", key)
			rec := httptest.NewRecorder()
			mw.ServeHTTP(rec, req)
			return rec.Code
		}
		require.Equal(t, http.StatusCreated, serve("warm-up")) // loads the scripts
		hook.take()

		require.Equal(t, http.StatusCreated, serve("k"))
		require.Equal(t, []string{"evalsha", "evalsha"}, hook.take(), "a new key: claim and completion")
		require.Equal(t, http.StatusCreated, serve("k"))
		require.Equal(t, []string{"evalsha"}, hook.take(), "a replay: the claim")

		done := make(chan int)
		go func() { done <- serve("held") }()
		require.Eventually(t, func() bool {
			_, err := s.Get(t.Context(), idempotency.Scope{Principal: "acct", Method: http.MethodPost,
				Route: "/payments", Key: "held"})
			return err == nil
		}, 10*time.Second, time.Millisecond)
		hook.take()
		require.Equal(t, http.StatusConflict, serve("held"))
		require.Equal(t, []string{"evalsha"}, hook.take(), "an in-progress conflict: the claim")
		close(release)
		require.Equal(t, http.StatusCreated, <-done)
	})
}

// TestScriptCalls counts the commands the Store's scripts run inside Redis
// for the middleware's requests, on a Redis of its own (INFO commandstats
// counts a script's inner calls): a new key's claim 6 (the record read,
// the nonce and the marker in one MGET, the record's write, its expiry,
// its lease index entry, the nonce) and completion 9, a replay's claim 2.
func TestScriptCalls(t *testing.T) {
	addr := startRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rdb.Close() })
	s := openStore(t, rdb, redisstore.WithPrefix("calls:"), redisstore.WithCheckInterval(time.Hour))
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"ch_1"}`))
	})
	mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil })).Wrap(h)
	serve := func(key string) {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		mw.ServeHTTP(rec, req)
		require.Equal(t, http.StatusCreated, rec.Code)
	}
	serve("warm-up") // loads the scripts
	calls := func() int {
		info, err := rdb.Info(t.Context(), "commandstats").Result()
		require.NoError(t, err)
		n := 0
		for line := range strings.Lines(info) {
			name, rest, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls=")
			switch {
			case !ok, strings.HasPrefix(name, "eval"):
				continue
			case name == "info", name == "hello", name == "client", name == "ping":
				continue // the count's own, and a new connection's
			}
			v, _, _ := strings.Cut(rest, ",")
			c, err := strconv.Atoi(v)
			require.NoError(t, err)
			n += c
		}
		return n
	}
	before := calls()
	serve("k")
	fresh := calls()
	serve("k")
	replay := calls()
	require.Equal(t, 6+9, fresh-before, "a new key's claim and completion")
	require.Equal(t, 2, replay-fresh, "a replay's claim")
}
