package budget

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func acquireN(b Budget, now time.Time, n int) (granted int) {
	for range n {
		if _, ok := b.AcquireRetry(now, false); ok {
			granted++
		}
	}
	return granted
}

func TestRatioWithoutFloor(t *testing.T) {
	r := NewRatio(RatioConfig{FloorPerSecond: -1})
	require.Equal(t, 0, r.Available(t0))
	require.Zero(t, acquireN(r, t0, 5), "no requests, no floor: nothing")
	for range 100 {
		r.OnRequest(t0)
	}
	require.Equal(t, 20, r.Available(t0))
	cost, ok := r.AcquireRetry(t0, true)
	require.True(t, ok)
	require.Equal(t, 1, cost, "every retry counts 1, whatever its kind")
	require.Equal(t, 19, acquireN(r, t0, 100), "20% of 100 requests")
	require.Equal(t, 0, r.Available(t0))
	r.OnSuccess(t0, 1)
	require.Equal(t, 0, r.Available(t0), "successes refund nothing")
	r.OnRequest(t0)
	require.Equal(t, 0, r.Available(t0), "101 requests fund 20.2 retries: still 20")
	for range 4 {
		r.OnRequest(t0)
	}
	require.Equal(t, 1, acquireN(r, t0, 5), "105 requests fund 21")
}

func TestRatioWindowSlides(t *testing.T) {
	r := NewRatio(RatioConfig{FloorPerSecond: -1}) // 10 s window of 1 s sub-buckets
	for range 100 {
		r.OnRequest(t0) // sub-bucket 0
	}
	require.Equal(t, 10, acquireN(r, t0.Add(5*time.Second), 10)) // sub-bucket 5
	require.Equal(t, 10, r.Available(t0.Add(9999*time.Millisecond)), "sub-bucket 9: window 0..9")
	require.Equal(t, 0, r.Available(t0.Add(10*time.Second)), "sub-bucket 10: the requests of sub-bucket 0 left the window")
	for range 50 {
		r.OnRequest(t0.Add(10 * time.Second))
	}
	require.Equal(t, 0, r.Available(t0.Add(10*time.Second)), "50 requests fund 10, already used by the retries of sub-bucket 5")
	require.Equal(t, 10, r.Available(t0.Add(15*time.Second)), "those retries left the window at sub-bucket 15")
	require.Equal(t, 0, r.Available(t0.Add(time.Hour)), "a long gap clears everything")
	require.Zero(t, acquireN(r, t0.Add(time.Hour), 3))
}

func TestRatioFloor(t *testing.T) {
	r := NewRatio(RatioConfig{}) // floor 10/s, burst 10
	require.Equal(t, 10, r.Available(t0))
	require.Equal(t, 10, acquireN(r, t0, 50), "the floor's burst, without any request")
	require.Equal(t, 0, r.Available(t0))
	require.Equal(t, 1, acquireN(r, t0.Add(100*time.Millisecond), 5), "10 per second")
	require.Equal(t, 10, acquireN(r, t0.Add(time.Minute), 50), "refilled up to the burst only")

	// Ratio credit is spent before the floor.
	r = NewRatio(RatioConfig{FloorPerSecond: 2, FloorBurst: 3})
	for range 10 {
		r.OnRequest(t0)
	}
	require.Equal(t, 5, r.Available(t0), "2 from the ratio, 3 from the floor")
	require.Equal(t, 5, acquireN(r, t0, 10))
}

func TestRatioTimeGoingBackwards(t *testing.T) {
	r := NewRatio(RatioConfig{})
	late := t0.Add(5 * time.Second)
	r.OnRequest(t0)
	require.Equal(t, 10, acquireN(r, late, 20), "floor burst spent at t0+5s")
	require.Zero(t, acquireN(r, t0, 1), "an earlier time is treated as the latest seen")
	require.Zero(t, acquireN(r, late, 1), "and does not refill the floor")
	for range 10 {
		r.OnRequest(t0) // counted in the latest sub-bucket
	}
	require.Equal(t, 2, acquireN(r, late, 5))

	z := NewRatio(RatioConfig{})
	z.OnRequest(time.Time{})
	far := time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	require.NotPanics(t, func() {
		z.AcquireRetry(far, false)
		z.OnRequest(far)
		z.Available(time.Time{})
	})
}

func TestRatioConfigDefaultsAndClamps(t *testing.T) {
	tiny := NewRatio(RatioConfig{Window: 5, Buckets: 10, FloorPerSecond: -1})
	require.Len(t, tiny.requests, 5, "at most one sub-bucket per nanosecond")
	require.Equal(t, time.Duration(1), tiny.width)

	zero := NewRatio(RatioConfig{})
	require.Equal(t, int64(200_000), zero.ppm)
	require.Equal(t, time.Second, zero.width)
	require.Len(t, zero.requests, 10)
	require.Equal(t, 10.0, float64(zero.floor.Limit()))
	require.Equal(t, 10, zero.floor.Burst())

	big := NewRatio(RatioConfig{Ratio: 1e300, FloorPerSecond: -1})
	for range 3 {
		big.OnRequest(t0)
	}
	require.Equal(t, 3000, big.Available(t0), "ratio clamped to 1000")
}

// A value Validate refuses is never the default in disguise: it grants
// fewer retries than asked (here none, with the floor off or refused too).
func TestRatioRefusedValuesGrantFewerRetries(t *testing.T) {
	for _, c := range []RatioConfig{
		{Ratio: -0.1, FloorPerSecond: -1},
		{Ratio: math.NaN(), FloorPerSecond: -1},
		{Ratio: 1e-9, FloorPerSecond: -1}, // below one part per million
		{Window: -time.Second, FloorPerSecond: -1},
		{Buckets: -1, FloorPerSecond: -1},
		{Ratio: -1, FloorPerSecond: math.NaN()},
		{Ratio: -1, FloorPerSecond: math.Inf(1)},
		{Ratio: -1, FloorPerSecond: 100, FloorBurst: -1},
	} {
		r := NewRatio(c)
		for range 100 {
			r.OnRequest(t0)
		}
		_, ok := r.AcquireRetry(t0, false)
		require.False(t, ok, "%+v", c)
		require.Zero(t, r.Available(t0), "%+v", c)
	}
	floorOnly := NewRatio(RatioConfig{Ratio: -1, FloorPerSecond: 2})
	for range 100 {
		floorOnly.OnRequest(t0)
	}
	require.Equal(t, 2, floorOnly.Available(t0), "the floor alone, its burst FloorPerSecond rounded up")
}

func TestRatioConfigValidate(t *testing.T) {
	require.NoError(t, RatioConfig{}.Validate())
	require.NoError(t, RatioConfig{Ratio: 0.5, Window: time.Minute, Buckets: 60, FloorPerSecond: -1, FloorBurst: 3}.Validate())
	for _, c := range []struct {
		cfg   RatioConfig
		field string
	}{
		{RatioConfig{Ratio: -0.1}, "RatioConfig.Ratio"},
		{RatioConfig{Ratio: math.NaN()}, "RatioConfig.Ratio"},
		{RatioConfig{Ratio: 1001}, "RatioConfig.Ratio"},
		{RatioConfig{Window: -time.Second}, "RatioConfig.Window"},
		{RatioConfig{Buckets: -1}, "RatioConfig.Buckets"},
		{RatioConfig{FloorPerSecond: math.Inf(-1)}, "RatioConfig.FloorPerSecond"},
		{RatioConfig{FloorBurst: -2}, "RatioConfig.FloorBurst"},
	} {
		err := c.cfg.Validate()
		require.ErrorIs(t, err, ErrInvalidConfig, c.field)
		require.Contains(t, err.Error(), c.field+"=")
	}
}

// TestRatioConcurrent: 64 goroutines record 6400 requests, then 64 goroutines
// race for retries at the same instant: exactly 20% plus the floor's burst.
func TestRatioConcurrent(t *testing.T) {
	r := NewRatio(RatioConfig{})
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				r.OnRequest(t0)
			}
		}()
	}
	wg.Wait()
	var granted atomic.Int64
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			granted.Add(int64(acquireN(r, t0, 100)))
		}()
	}
	wg.Wait()
	require.Equal(t, int64(6400/5+10), granted.Load())
	require.Equal(t, 0, r.Available(t0))
}

// ratioEvent is one call in the property test's log.
type ratioEvent struct {
	at      time.Time
	request bool // OnRequest; otherwise AcquireRetry
	granted bool
}

// TestRatioProperty drives Ratio budgets with seeded random traffic (bursts,
// quiet spells, failure storms, repeated instants) and checks, from the log of
// calls alone, the documented guarantee for intervals [a, g] ending at every
// grant g (the binding case) and starting a sub-bucket, a window, two and
// seven windows earlier, and at the start:
//
//	retries in [a, g] <= Ratio * requests in (a-Window, g] + FloorBurst + FloorPerSecond*(g-a)
//
// Without a floor it also checks, at every grant, retries(W(g)) <=
// Ratio*requests(W(g)), that every denial was justified, and that the bound
// is reached.
func TestRatioProperty(t *testing.T) {
	type tc struct {
		ratio   float64
		window  time.Duration
		buckets int
		perSec  float64 // -1: no floor
	}
	cases := []tc{{0.2, 10 * time.Second, 10, 10}, {0.2, 10 * time.Second, 10, -1}}
	rng := rand.New(rand.NewPCG(2026, 4))
	for range 10 {
		cases = append(cases, tc{
			ratio:   []float64{0.05, 0.1, 0.2, 0.5, 1}[rng.IntN(5)],
			window:  []time.Duration{time.Second, 3 * time.Second, 10 * time.Second, time.Minute}[rng.IntN(4)],
			buckets: []int{1, 3, 10, 20}[rng.IntN(4)],
			perSec:  []float64{-1, 1, 2.5, 10}[rng.IntN(4)],
		})
	}
	for i, c := range cases {
		t.Run(fmt.Sprintf("%d_ratio%g_window%s_buckets%d_floor%g", i, c.ratio, c.window, c.buckets, c.perSec), func(t *testing.T) {
			cfg := RatioConfig{Ratio: c.ratio, Window: c.window, Buckets: c.buckets, FloorPerSecond: c.perSec}
			r := NewRatio(cfg)
			log := randomTraffic(r, rand.New(rand.NewPCG(uint64(i), 7)), 20_000)
			checkRatioLog(t, cfg, log)
		})
	}
}

func randomTraffic(b Budget, rng *rand.Rand, n int) []ratioEvent {
	log := make([]ratioEvent, 0, n)
	now := t0
	var maxGap time.Duration
	var pRequest float64
	for i := range n {
		if i%500 == 0 { // a new phase
			maxGap = []time.Duration{0, time.Millisecond, 20 * time.Millisecond, 300 * time.Millisecond, 3 * time.Second}[rng.IntN(5)]
			pRequest = []float64{0, 0.1, 0.5, 0.83, 0.95, 1}[rng.IntN(6)]
		}
		if maxGap > 0 {
			now = now.Add(time.Duration(rng.Int64N(int64(maxGap))))
		}
		e := ratioEvent{at: now, request: rng.Float64() < pRequest}
		if e.request {
			b.OnRequest(now)
		} else {
			_, e.granted = b.AcquireRetry(now, rng.IntN(2) == 1)
		}
		log = append(log, e)
	}
	return log
}

func checkRatioLog(t *testing.T, cfg RatioConfig, log []ratioEvent) {
	t.Helper()
	ppm := int64(math.Round(cfg.Ratio * 1e6))
	// floorBound is the most grants the floor limiter allows in a span of d.
	floorBound := func(d time.Duration) int64 {
		if cfg.FloorPerSecond <= 0 {
			return 0
		}
		return int64(math.Floor(math.Ceil(cfg.FloorPerSecond) + cfg.FloorPerSecond*d.Seconds() + 1e-9))
	}
	width := cfg.Window / time.Duration(cfg.Buckets)
	origin := log[0].at
	idx := func(at time.Time) int64 { return int64(at.Sub(origin) / width) }
	// Prefix sums: req[i], ret[i] count the events before index i.
	req := make([]int64, len(log)+1)
	ret := make([]int64, len(log)+1)
	for i, e := range log {
		req[i+1], ret[i+1] = req[i], ret[i]
		if e.request {
			req[i+1]++
		} else if e.granted {
			ret[i+1]++
		}
	}
	// first returns the index of the first event satisfying ok (monotonic).
	first := func(ok func(e ratioEvent) bool) int {
		return sort.Search(len(log), func(i int) bool { return ok(log[i]) })
	}
	spans := []time.Duration{width, cfg.Window - width, cfg.Window, 2 * cfg.Window, 7 * cfg.Window}
	var grants, denials, tight int64
	for i, e := range log {
		if e.request {
			continue
		}
		// Counts include event i itself: a call sees what happened before it.
		k := idx(e.at)
		lo := first(func(x ratioEvent) bool { return idx(x.at) >= k-int64(cfg.Buckets)+1 })
		wReq, wRet := req[i+1]-req[lo], ret[i+1]-ret[lo]
		if !e.granted {
			denials++
			if cfg.FloorPerSecond <= 0 {
				require.Greater(t, (wRet+1)*1_000_000, ppm*wReq, "denied at event %d although W(g) had credit", i)
			}
			continue
		}
		grants++
		if cfg.FloorPerSecond <= 0 {
			require.LessOrEqual(t, wRet*1_000_000, ppm*wReq, "event %d: %d retries in W(g) vs %d requests", i, wRet, wReq)
			if (wRet+1)*1_000_000 > ppm*wReq {
				tight++ // no room left for one more
			}
		}
		for _, span := range append(spans, e.at.Sub(origin)) {
			a := e.at.Add(-span)
			loRet := first(func(x ratioEvent) bool { return !x.at.Before(a) })
			loReq := first(func(x ratioEvent) bool { return x.at.After(a.Add(-cfg.Window)) })
			retries, requests := ret[i+1]-ret[loRet], req[i+1]-req[loReq]
			require.LessOrEqual(t, (retries-floorBound(span))*1_000_000, ppm*requests,
				"event %d, interval of %s: %d retries vs %d requests (ratio %g, floor %d)", i, span, retries, requests, cfg.Ratio, floorBound(span))
		}
	}
	require.Positive(t, grants, "the budget granted something")
	require.Positive(t, denials, "the traffic exercised denials")
	if cfg.FloorPerSecond <= 0 {
		require.Positive(t, tight, "the bound was reached")
	}
	t.Logf("%d events, %d grants, %d denials", len(log), grants, denials)
}

func TestRatioRefundGivesBackARatioGrant(t *testing.T) {
	r := NewRatio(RatioConfig{Ratio: 0.5, FloorPerSecond: -1})
	for range 4 {
		r.OnRequest(t0)
	}
	require.Equal(t, 2, r.Available(t0))
	cost, ok := r.AcquireRetry(t0, false)
	require.True(t, ok)
	require.Equal(t, 1, r.Available(t0))
	r.Refund(t0.Add(time.Second), cost)
	require.Equal(t, 2, r.Available(t0.Add(time.Second)), "the grant, one sub-bucket older, is back")
	r.Refund(t0.Add(time.Second), cost)
	require.Equal(t, 2, r.Available(t0.Add(time.Second)), "no grant left in the window: nothing to give back")
	r.Refund(t0, 0)
	require.Equal(t, 2, r.Available(t0))
}
