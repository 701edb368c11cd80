// Package latency keeps a host's recent latencies to its response headers,
// for the adaptive hedge delay of the saferetry Transport: a histogram on a
// log scale whose counts halve every HalfLife answers, and its p95.
package latency

import (
	"math"
	"sync"
	"time"
)

// The estimate's bounds.
const (
	MinDelay  = 5 * time.Millisecond // the lowest p95 reported
	MaxDelay  = 10 * time.Second     // the highest p95 reported
	MinSample = 20                   // answers before P95 reports one
	HalfLife  = 256                  // answers after which the counts halve
)

// perDoubling is the histogram's buckets per doubling of the latency.
const perDoubling = 4

// buckets is the histogram's size: bucket 0 holds latencies below
// MinDelay, bucket i > 0 those below MinDelay * 2^(i/perDoubling), the
// last one everything longer.
var buckets = 2 + int(math.Ceil(perDoubling*math.Log2(float64(MaxDelay)/float64(MinDelay))))

// Estimate is a host's recent latencies. Build it with New; safe for
// concurrent use.
type Estimate struct {
	mu     sync.Mutex
	counts []uint32
	total  uint32 // the sum of counts
	since  int    // answers since the last halving
	seen   int    // answers in all, up to MinSample
}

// New returns an empty Estimate.
func New() *Estimate { return &Estimate{counts: make([]uint32, buckets)} }

// Add records one answer's latency.
func (e *Estimate) Add(d time.Duration) {
	i := 0
	if d >= MinDelay {
		i = 1 + int(perDoubling*math.Log2(float64(d)/float64(MinDelay)))
		i = min(i, len(e.counts)-1)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.counts[i]++
	e.total++
	e.seen = min(e.seen+1, MinSample)
	if e.since++; e.since >= HalfLife {
		e.since, e.total = 0, 0
		for j := range e.counts {
			e.counts[j] /= 2
			e.total += e.counts[j]
		}
	}
}

// P95 returns the upper bound of the bucket that holds the 95th
// percentile, clamped to MinDelay..MaxDelay, and false while the estimate
// has fewer than MinSample answers.
func (e *Estimate) P95() (time.Duration, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.seen < MinSample || e.total == 0 {
		return 0, false
	}
	rank := uint32(math.Ceil(0.95 * float64(e.total)))
	var sum uint32
	for i, n := range e.counts {
		if sum += n; sum >= rank {
			if i == 0 {
				return MinDelay, true
			}
			d := time.Duration(float64(MinDelay) * math.Exp2(float64(i)/perDoubling))
			return min(d, MaxDelay), true
		}
	}
	return MaxDelay, true
}
