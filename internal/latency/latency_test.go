package latency

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The estimate is the p95 of the host's recent answers, rounded up to its
// bucket (at most a fourth of a doubling), clamped to 5 ms..10 s, and none
// before 20 answers.
func TestTheEstimateIsTheRecentP95(t *testing.T) {
	e := New()
	for range MinSample - 1 {
		e.Add(time.Millisecond)
	}
	_, ok := e.P95()
	assert.False(t, ok, "too few answers")
	e.Add(time.Millisecond)
	d, ok := e.P95()
	require.True(t, ok)
	assert.Equal(t, MinDelay, d, "a fast host: the lower bound")

	e = New()
	for i := range 100 {
		lat := 20 * time.Millisecond
		if i%10 == 0 {
			lat = 400 * time.Millisecond // the slowest 10%
		}
		e.Add(lat)
	}
	d, _ = e.P95()
	assert.GreaterOrEqual(t, d, 400*time.Millisecond, "the p95 is among the slowest 10%")
	assert.Less(t, d, 400*time.Millisecond*119/100, "rounded up by less than a fourth of a doubling")

	e = New()
	for range 100 {
		e.Add(time.Minute)
	}
	d, _ = e.P95()
	assert.Equal(t, MaxDelay, d, "a slow host: the upper bound")

	// Recent: after a few half-lives of fast answers, a slow past is
	// forgotten.
	for range 4 * HalfLife {
		e.Add(30 * time.Millisecond)
	}
	d, _ = e.P95()
	assert.GreaterOrEqual(t, d, 30*time.Millisecond)
	assert.Less(t, d, 36*time.Millisecond)
}
