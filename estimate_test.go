package saferetry

import (
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The adaptive delay is the p95 of the host's recent answers, rounded up
// to its bucket (at most a fourth of a doubling), clamped to 5 ms..10 s,
// and none before 20 answers.
func TestTheAdaptiveDelayIsTheRecentP95(t *testing.T) {
	e := newEstimate()
	for range minHedgeSample - 1 {
		e.add(time.Millisecond)
	}
	_, ok := e.p95()
	assert.False(t, ok, "too few answers")
	e.add(time.Millisecond)
	d, ok := e.p95()
	require.True(t, ok)
	assert.Equal(t, minHedgeDelay, d, "a fast host: the lower bound")

	e = newEstimate()
	for i := range 100 {
		lat := 20 * time.Millisecond
		if i%10 == 0 {
			lat = 400 * time.Millisecond // the slowest 10%
		}
		e.add(lat)
	}
	d, _ = e.p95()
	assert.GreaterOrEqual(t, d, 400*time.Millisecond, "the p95 is among the slowest 10%")
	assert.Less(t, d, 400*time.Millisecond*119/100, "rounded up by less than a fourth of a doubling")

	e = newEstimate()
	for range 100 {
		e.add(time.Minute)
	}
	d, _ = e.p95()
	assert.Equal(t, maxHedgeDelay, d, "a slow host: the upper bound")

	// Recent: after a few half-lives of fast answers, a slow past is
	// forgotten.
	for range 4 * halfLife {
		e.add(30 * time.Millisecond)
	}
	d, _ = e.p95()
	assert.GreaterOrEqual(t, d, 30*time.Millisecond)
	assert.Less(t, d, 36*time.Millisecond)
}

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
		for range minHedgeSample - 1 {
			call("/fast")
		}
		mu.Lock()
		assert.Len(t, hits, minHedgeSample)
		mu.Unlock()
		took := call("/slow")
		assert.Equal(t, minHedgeDelay+time.Millisecond, took, "hedged at 5 ms, answered 1 ms later")
		synctest.Wait()
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, hits, minHedgeSample+2)
		assert.Equal(t, minHedgeDelay, hits[len(hits)-1].Sub(hits[len(hits)-2]))
	})
}
