package saferetry

import (
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/internal/latency"
)

func TestEachHostHasItsOwnEstimate(t *testing.T) {
	tr := NewTransport(nil, WithHedging(Hedging{}))
	a, b := tr.est.For("a.example:443"), tr.est.For("b.example:443")
	assert.NotSame(t, a, b)
	assert.Same(t, a, tr.est.For("A.Example:443"), "hosts compare case-insensitively")
	assert.Nil(t, NewTransport(nil, WithHedging(Hedging{Delay: time.Millisecond})).est,
		"a fixed delay keeps no estimate")
}

// With the adaptive delay, a host hedges once it has 20 answers, at their
// p95 (here the 5 ms lower bound: the host answers in 1 ms).
func TestTheAdaptiveDelayHedgesAfterTheWarmUp(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var hits []time.Time
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			hits = append(hits, time.Now())
			mu.Unlock()
			d := time.Millisecond
			if r.URL.Path == "/slow" && r.Header.Get(attemptHeader) == "1" {
				d = time.Second
			}
			select {
			case <-time.After(d):
			case <-r.Context().Done():
			}
		})
		base, url := pipeServer(t, h)
		tr := newBubbleTransport(base, WithHedging(Hedging{}))
		call := func(path string) time.Duration {
			start := time.Now()
			resp, err := tr.RoundTrip(get(t, url+path))
			require.NoError(t, err)
			resp.Body.Close()
			return time.Since(start)
		}
		assert.Equal(t, time.Second, call("/slow"), "no estimate yet: no hedge")
		for range latency.MinSample - 1 {
			call("/fast")
		}
		mu.Lock()
		assert.Len(t, hits, latency.MinSample)
		mu.Unlock()
		took := call("/slow")
		assert.Equal(t, latency.MinDelay+time.Millisecond, took, "hedged at 5 ms, answered 1 ms later")
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, hits, latency.MinSample+2)
		assert.Equal(t, latency.MinDelay, hits[len(hits)-1].Sub(hits[len(hits)-2]))
	})
}
