package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// heartbeat extends a run's lease every lease/3 while its handler runs. It
// is a timer (time.AfterFunc), not a goroutine: nothing runs between beats.
//
// A beat whose try fails without an answer of the store's (a pooled
// connection that died, idle or under its statement) is tried again by the
// gateway, on a fresh connection, 20 ms later, doubled, at most 1 s, until
// the beat's deadline (or for 10 s: the next beat then comes by the
// deadline). A try that hangs holds the beat until that deadline. The
// handler's context is canceled only when its lease is lost:
//
//   - the store answers ErrLeaseLost (the record has another owner or
//     generation, or is gone): at once, with cause ErrLeaseLost;
//   - no try got through by the deadline, when a sixth of the lease is
//     left: with a cause that wraps ErrLeaseLost and the store's last
//     error (errLeaseExpired), and the run is marked expired (no phase may
//     start).
//
// The bound, on this server's clock, with L the lease and U the lease end
// that the last beat that got through (or the claim) wrote: every try of a
// beat ends by its deadline D = U - L/6, and at D the handler is canceled
// unless one got through. A successor takes the record over once its own
// clock passes U: with clocks at most e apart, not before U - e on this
// one. So the tries have ended and the handler is stopped L/6 - e before
// any successor may run: the servers' clocks must agree to well within
// L/6 (5 s at the default lease of 30 s), the rest being the handler's
// time to see its cancellation. A beat that starts at s writes U' = s + L,
// a lease counted from before its write, however long its tries took; the
// next starts at s + L/3 (fixed rate; the first when the claim's lease has
// 2L/3 left), so its tries have until U' - L/6 = s + 5L/6: L/2 each. A
// write sent before D and applied by the store after it is harmless: under
// a successor's generation it fails with ErrLeaseLost; otherwise it
// extends the lease of an owner whose handler is stopped, and which
// settles its record, fenced, as any owner does.
type heartbeat struct {
	m   *Middleware
	run *Run

	mu       sync.Mutex
	timer    *time.Timer
	stopped  bool
	inFlight sync.WaitGroup // a beat that started before stop
}

func (hb *heartbeat) start(m *Middleware, run *Run) {
	hb.m, hb.run = m, run
	// The first beat, as every later one, when 2L/3 of the lease is left:
	// the claim's lease was counted from before its round trip.
	third := m.cfg.lease / 3
	first := min(max(time.Until(run.leaseEnd().Add(-2*third)), 0), third)
	hb.mu.Lock() // the first beat reschedules through hb.timer: set it first
	hb.timer = time.AfterFunc(first, hb.beat)
	hb.mu.Unlock()
}

// stop ends the heartbeat: no beat starts after it, and a beat still in
// flight has no effect when it returns. It does not wait for that beat
// (drain does): on SQLite the beat may wait for the write lock that the
// request's own unit holds until it commits.
func (hb *heartbeat) stop() {
	hb.mu.Lock()
	defer hb.mu.Unlock()
	hb.stopped = true
	if hb.timer != nil { // nil: never started (a claim in one transaction)
		hb.timer.Stop()
	}
}

// drain waits for a beat still in flight after stop.
func (hb *heartbeat) drain() { hb.inFlight.Wait() }

// begin reports whether a beat may start, and counts it in flight.
func (hb *heartbeat) begin() bool {
	hb.mu.Lock()
	defer hb.mu.Unlock()
	if hb.stopped {
		return false
	}
	hb.inFlight.Add(1)
	return true
}

func (hb *heartbeat) isStopped() bool {
	hb.mu.Lock()
	defer hb.mu.Unlock()
	return hb.stopped
}

// beat is one heartbeat, run by the timer.
func (hb *heartbeat) beat() {
	if !hb.begin() {
		return
	}
	defer hb.inFlight.Done()
	m, run := hb.m, hb.run
	third, margin := m.cfg.lease/3, m.cfg.lease/6
	start := time.Now()
	until := start.Add(m.cfg.lease)
	deadline := run.leaseEnd().Add(-margin)
	ctx, cancel := context.WithDeadline(run.bg, deadline)
	err := m.g.heartbeat(ctx, run.Lease, until)
	cancel()
	if hb.isStopped() {
		// The handler is done: this late beat changes nothing, and a lease
		// it finds gone (the record completed or given up meanwhile) is no
		// loss.
		return
	}
	// Fixed rate from the beat's start, so that a slow beat does not eat
	// into the next one's tries; never a busy loop on a slow store.
	next := max(third-time.Since(start), third/10)
	switch {
	case err == nil:
		run.extend(until)
	case errors.Is(err, ErrLeaseLost):
		run.cancelWork(ErrLeaseLost)
		return
	case run.expiring(time.Now(), margin):
		run.cancelWork(fmt.Errorf("%w: %w", errLeaseExpired, err))
		return
	default: // given up before the deadline: the next beat comes by it
		next = min(next, time.Until(deadline))
	}
	hb.mu.Lock()
	if !hb.stopped {
		hb.timer.Reset(next)
	}
	hb.mu.Unlock()
}
