package saferetry_test

import (
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
)

const (
	fleetWorkers  = 32
	fleetRequests = 2000
)

// fastBackoff keeps these tests fast: the default backoff sleeps real time
// (base 50 ms), and what is under test here is the budget, not the backoff,
// so the waits shrink to at most a few milliseconds.
var fastBackoff = saferetry.WithBackoff(jitter.Config{
	Base: time.Millisecond, ThrottleBase: time.Millisecond, Cap: 5 * time.Millisecond,
})

// fleetServer is a real HTTP server that counts the attempts reaching it and
// answers each with status(n), n counting from 0.
type fleetServer struct {
	*httptest.Server
	hits atomic.Int64
}

func newFleetServer(t *testing.T, status func(n int64) int) *fleetServer {
	t.Helper()
	s := &fleetServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.hits.Add(1) - 1
		w.WriteHeader(status(n))
		io.WriteString(w, "ok")
	}))
	t.Cleanup(s.Close)
	return s
}

// sendFleet sends fleetRequests logical GET requests from fleetWorkers
// goroutines through one Transport built with opts (plus a discard logger)
// and returns how many ended with 200 OK.
func sendFleet(t *testing.T, url string, opts ...saferetry.Option) (ok int) {
	t.Helper()
	base := &http.Transport{MaxIdleConnsPerHost: fleetWorkers}
	t.Cleanup(base.CloseIdleConnections)
	opts = append([]saferetry.Option{saferetry.WithLogger(slog.New(slog.DiscardHandler))}, opts...)
	client := &http.Client{Transport: saferetry.NewTransport(base, opts...)}

	var next, succeeded atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, fleetWorkers)
	for range fleetWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= fleetRequests {
				resp, err := client.Get(url)
				if err != nil {
					errs <- err
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					succeeded.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	return int(succeeded.Load())
}

// A server answering 503 to everything. With the default
// budget's numbers (a token bucket of 500 tokens, 14 per transient retry),
// refilled only by successes, the fleet makes exactly 35 retries in all and
// then sends every request once; without a budget every request is tried 3
// times. (The default bucket's refill with time, 500 tokens a minute, is
// left out: this test runs in real time.)
func TestFleetFullOutageAmplification(t *testing.T) {
	t.Run("token bucket", func(t *testing.T) {
		srv := newFleetServer(t, func(int64) int { return http.StatusServiceUnavailable })
		ok := sendFleet(t, srv.URL, fastBackoff,
			// A fresh registry: the process-wide one is shared by every test.
			saferetry.WithBudget(budget.NewRegistry(func() budget.Budget {
				return budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
			})))
		assert.Zero(t, ok)
		hits := srv.hits.Load()
		amplification := float64(hits) / fleetRequests
		t.Logf("server hits %d for %d logical requests: amplification %.4f", hits, fleetRequests, amplification)
		assert.LessOrEqual(t, amplification, 1.10)
		assert.Equal(t, int64(fleetRequests+500/14), hits, "the bucket pays for 35 retries, then none")
	})
	t.Run("no budget", func(t *testing.T) {
		srv := newFleetServer(t, func(int64) int { return http.StatusServiceUnavailable })
		ok := sendFleet(t, srv.URL, fastBackoff, saferetry.WithBudget(budget.Unlimited()))
		assert.Zero(t, ok)
		hits := srv.hits.Load()
		t.Logf("server hits %d for %d logical requests: amplification %.4f", hits, fleetRequests, float64(hits)/fleetRequests)
		assert.Equal(t, int64(3*fleetRequests), hits)
	})
}

// A server failing 10% of requests at random (seeded). With
// the default settings the budget never runs dry (a retried success refunds
// its cost, first-try successes add a token), so nearly every request
// succeeds within its 3 attempts and the load grows by about 11%.
func TestFleetTenPercentFailures(t *testing.T) {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(2026, 10))
	srv := newFleetServer(t, func(int64) int {
		mu.Lock()
		defer mu.Unlock()
		if rng.Float64() < 0.10 {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	reg := budget.NewRegistry(nil)
	ok := sendFleet(t, srv.URL, fastBackoff, saferetry.WithBudget(reg))
	hits := srv.hits.Load()
	success := float64(ok) / fleetRequests
	amplification := float64(hits) / fleetRequests
	t.Logf("success %d/%d (%.2f%%), server hits %d: amplification %.4f, tokens left %d",
		ok, fleetRequests, 100*success, hits, amplification, reg.For(srv.Listener.Addr().String()).Available(time.Now()))
	assert.GreaterOrEqual(t, success, 0.99)
	assert.LessOrEqual(t, amplification, 1.15)
	assert.Greater(t, amplification, 1.05, "about 10% of requests must have been retried")
}
