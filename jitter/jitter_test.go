package jitter

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const ms = time.Millisecond

func TestFormulasExactValues(t *testing.T) {
	base, capD := 100*ms, 10*time.Second
	tests := []struct {
		name    string
		f       Func
		attempt int
		prev    time.Duration
		base    time.Duration
		cap     time.Duration
		r       float64
		want    time.Duration
	}{
		{"full first r=0", Full, 0, 0, base, capD, 0, 0},
		{"full first r=0.5", Full, 0, 0, base, capD, 0.5, 50 * ms},
		{"full attempt 3 r=0.25", Full, 3, 0, base, capD, 0.25, 200 * ms},
		{"full capped", Full, 10, 0, base, capD, 0.5, 5 * time.Second},
		{"full ignores prev", Full, 1, time.Hour, base, capD, 0.5, 100 * ms},
		{"full negative attempt is 0", Full, -5, 0, base, capD, 0.5, 50 * ms},
		{"full r>=1 clamped below 1", Full, 0, 0, base, capD, 7, base - 1},
		{"full r<0 clamped to 0", Full, 4, 0, base, capD, -3, 0},
		{"full NaN r is 0", Full, 4, 0, base, capD, math.NaN(), 0},
		{"full +Inf r clamped", Full, 0, 0, base, capD, math.Inf(1), base - 1},
		{"full zero base", Full, 5, 0, 0, capD, 0.9, 0},
		{"full negative base", Full, 5, 0, -time.Second, capD, 0.9, 0},
		{"full base above cap", Full, 0, 0, time.Minute, capD, 0.5, 5 * time.Second},
		{"full zero cap is uncapped", Full, 10, 0, base, 0, 0.5, 51200 * ms},
		{"equal first r=0", Equal, 0, 0, base, capD, 0, 50 * ms},
		{"equal first r=0.5", Equal, 0, 0, base, capD, 0.5, 75 * ms},
		{"equal attempt 2 r=0.5", Equal, 2, 0, base, capD, 0.5, 300 * ms},
		{"equal capped r=0", Equal, 20, 0, base, capD, 0, 5 * time.Second},
		{"decorrelated first uses base as prev r=0", Decorrelated, 0, 0, base, capD, 0, 100 * ms},
		{"decorrelated first r=0.5", Decorrelated, 0, 0, base, capD, 0.5, 200 * ms},
		{"decorrelated prev 1s r=0.5", Decorrelated, 7, time.Second, base, capD, 0.5, 1550 * ms},
		{"decorrelated capped", Decorrelated, 0, 8 * time.Second, base, capD, 0.9, capD},
		{"decorrelated ignores attempt", Decorrelated, 1000, 0, base, capD, 0.5, 200 * ms},
		{"decorrelated huge prev saturates", Decorrelated, 0, maxDuration, base, 0, 0.5, base + scale(maxDuration-base, 0.5)},
		{"none attempt 0", None, 0, 0, base, capD, 0.7, 100 * ms},
		{"none attempt 4", None, 4, 0, base, capD, 0.7, 1600 * ms},
		{"none capped", None, 7, 0, base, capD, 0.7, capD},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.f(tc.attempt, tc.prev, tc.base, tc.cap, tc.r))
		})
	}
}

func TestFormulasHugeAttemptsNeverOverflow(t *testing.T) {
	funcs := map[string]Func{"full": Full, "equal": Equal, "decorrelated": Decorrelated, "none": None}
	attempts := []int{30, 62, 63, 64, 100, 1 << 20, math.MaxInt}
	bases := []time.Duration{1, ms, time.Second, time.Hour, maxDuration / 2, maxDuration}
	caps := []time.Duration{0, -1, time.Second, 20 * time.Second, maxDuration}
	for name, f := range funcs {
		for _, a := range attempts {
			for _, b := range bases {
				for _, c := range caps {
					for _, r := range []float64{0, 0.5, math.Nextafter(1, 0), 1} {
						d := f(a, maxDuration, b, c, r)
						require.GreaterOrEqual(t, d, time.Duration(0), "%s(%d, base=%v, cap=%v, r=%v)", name, a, b, c, r)
						if c > 0 {
							require.LessOrEqual(t, d, c, "%s(%d, base=%v, cap=%v, r=%v)", name, a, b, c, r)
						}
					}
				}
			}
		}
	}
	// None with huge attempts is exactly the cap, or the largest duration when uncapped.
	require.Equal(t, 20*time.Second, None(math.MaxInt, 0, 50*ms, 20*time.Second, 0))
	require.Equal(t, maxDuration, None(math.MaxInt, 0, 50*ms, 0, 0))
	require.Equal(t, maxDuration, None(63, 0, 1, 0, 0))
	require.Equal(t, time.Duration(1<<62), None(62, 0, 1, 0, 0))
}

func TestFormulasBounds(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	base, capD := 50*ms, 20*time.Second
	prev := time.Duration(0)
	for i := 0; i < 20000; i++ {
		attempt := rng.IntN(80)
		r := rng.Float64()
		exp := None(attempt, 0, base, capD, 0)

		f := Full(attempt, 0, base, capD, r)
		require.GreaterOrEqual(t, f, time.Duration(0))
		require.Less(t, f, exp)

		e := Equal(attempt, 0, base, capD, r)
		require.GreaterOrEqual(t, e, exp-exp/2)
		require.LessOrEqual(t, e, exp)

		d := Decorrelated(attempt, prev, base, capD, r)
		require.GreaterOrEqual(t, d, base)
		require.LessOrEqual(t, d, capD)
		require.LessOrEqual(t, d, max(prev, base)*3)
		prev = d
	}
}

// TestFullStatistics checks, with a seeded source, that Full spreads waits
// uniformly over [0, min(cap, base*2^attempt)): mean near half the ceiling and
// every decile populated roughly equally.
func TestFullStatistics(t *testing.T) {
	rng := rand.New(rand.NewPCG(42, 7))
	const n = 100000
	base, capD := 50*ms, 20*time.Second
	ceiling := None(3, 0, base, capD, 0) // 400ms
	var sum float64
	var buckets [10]int
	for i := 0; i < n; i++ {
		d := Full(3, 0, base, capD, rng.Float64())
		sum += float64(d)
		buckets[int(10*float64(d)/float64(ceiling))]++
	}
	mean := sum / n
	require.InDelta(t, float64(ceiling)/2, mean, float64(ceiling)*0.01, "mean of full jitter should be half the ceiling")
	for i, c := range buckets {
		require.InDelta(t, n/10, c, n/10*0.05, "decile %d", i)
	}

	// Decorrelated's mean grows but stays below the cap; Equal's mean is 3/4 of the ceiling.
	var eqSum float64
	for i := 0; i < n; i++ {
		eqSum += float64(Equal(3, 0, base, capD, rng.Float64()))
	}
	require.InDelta(t, 0.75*float64(ceiling), eqSum/n, float64(ceiling)*0.01)
}

func TestConfigDefaults(t *testing.T) {
	var c Config
	require.Equal(t, 25*ms, c.Backoff(0, 0, false, 0.5), "full jitter over the 50ms transient base")
	require.Equal(t, 500*ms, c.Backoff(0, 0, true, 0.5), "throttling uses the 1s base")
	require.Equal(t, 10*time.Second, c.Backoff(100, 0, false, 0.5), "20s cap")
	require.Equal(t, 10*time.Second, c.Backoff(math.MaxInt, 0, true, 0.5))

	neg := Config{Base: -1, ThrottleBase: -1, Cap: -1}
	require.Zero(t, neg.Backoff(0, 0, false, 0.5), "a negative base is no wait, not the default")
	require.Zero(t, neg.Backoff(3, 0, true, 0.5))
	uncapped := Config{Func: None, Base: time.Second, Cap: -1}
	require.Equal(t, 1024*time.Second, uncapped.Backoff(10, 0, false, 0.5), "a negative cap is no cap")
	require.Equal(t, maxDuration, uncapped.Backoff(100, 0, false, 0.5))

	custom := Config{Func: None, Base: 10 * ms, ThrottleBase: 2 * time.Second, Cap: 5 * time.Second}
	require.Equal(t, 40*ms, custom.Backoff(2, 0, false, 0.99))
	require.Equal(t, 4*time.Second, custom.Backoff(1, 0, true, 0))
	require.Equal(t, 5*time.Second, custom.Backoff(2, 0, true, 0))

	dec := Config{Func: Decorrelated}
	require.Equal(t, 175*ms, dec.Backoff(0, 100*ms, false, 0.5)) // 50ms + 0.5*(3*100ms - 50ms)
}

func TestConfigClampsMisbehavingFunc(t *testing.T) {
	neg := Config{Func: func(int, time.Duration, time.Duration, time.Duration, float64) time.Duration { return -time.Second }}
	require.Equal(t, time.Duration(0), neg.Backoff(0, 0, false, 0.5))
	huge := Config{Func: func(int, time.Duration, time.Duration, time.Duration, float64) time.Duration { return time.Hour }}
	require.Equal(t, defaultCap, huge.Backoff(0, 0, false, 0.5))
}
