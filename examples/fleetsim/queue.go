package main

import (
	"math"
	"math/rand/v2"
	"time"
)

// event is one message in flight in a simulation. Its meaning depends on
// kind; who names the client (or request) it belongs to and val carries a
// payload (a version number, a success flag).
type event struct {
	at   time.Duration // simulated time since the start of the run
	seq  uint64        // insertion order: ties on at are broken by it, so runs are deterministic
	who  int32
	kind uint8
	val  int64
}

// queue is a binary min-heap of events ordered by (at, seq).
type queue struct {
	ev  []event
	seq uint64
}

func (q *queue) len() int { return len(q.ev) }

func (q *queue) push(e event) {
	e.seq = q.seq
	q.seq++
	q.ev = append(q.ev, e)
	i := len(q.ev) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !q.less(i, p) {
			break
		}
		q.ev[i], q.ev[p] = q.ev[p], q.ev[i]
		i = p
	}
}

func (q *queue) pop() event {
	top := q.ev[0]
	last := len(q.ev) - 1
	q.ev[0] = q.ev[last]
	q.ev = q.ev[:last]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < last && q.less(l, m) {
			m = l
		}
		if r < last && q.less(r, m) {
			m = r
		}
		if m == i {
			return top
		}
		q.ev[i], q.ev[m] = q.ev[m], q.ev[i]
		i = m
	}
}

func (q *queue) less(i, j int) bool {
	a, b := &q.ev[i], &q.ev[j]
	return a.at < b.at || (a.at == b.at && a.seq < b.seq)
}

// network models the one-way delay of a message as in Brooker's simulator:
// |Normal(mean, sd)|.
type network struct {
	mean, sd float64 // nanoseconds
	rng      *rand.Rand
}

func newNetwork(mean, sd time.Duration, rng *rand.Rand) network {
	return network{mean: float64(mean), sd: float64(sd), rng: rng}
}

func (n network) delay() time.Duration {
	return time.Duration(math.Abs(n.rng.NormFloat64()*n.sd + n.mean))
}

// stream derives the random stream of one run from its coordinates, so that
// every run has its own reproducible randomness whatever the order in which
// worker goroutines pick runs up.
func stream(parts ...uint64) uint64 {
	h := uint64(0x9e3779b97f4a7c15)
	for _, p := range parts {
		h ^= p + 0x9e3779b97f4a7c15 + (h << 6) + (h >> 2)
		h *= 0xbf58476d1ce4e5b9
		h ^= h >> 31
	}
	return h
}
