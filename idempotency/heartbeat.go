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
// A lost lease cancels the handler's context with cause ErrLeaseLost;
// failures that last until less than lease/3 of the lease is left cancel it
// with a cause that wraps ErrLeaseLost and the store's error, and mark the
// run expired (no phase may start), before a successor can take over.
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
	hb.mu.Lock() // the first beat reschedules through hb.timer: set it first
	hb.timer = time.AfterFunc(m.cfg.lease/3, hb.beat)
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
	hb.timer.Stop()
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
	third := m.cfg.lease / 3
	start := time.Now()
	until := start.Add(m.cfg.lease)
	// Half the margin: a beat that hangs gives up while the lease still has
	// time left for the next one.
	ctx, cancel := context.WithTimeout(run.bg, third/2)
	err := m.g.heartbeat(ctx, run.Lease, until)
	cancel()
	if hb.isStopped() {
		// The handler is done: this late beat changes nothing, and a lease
		// it finds gone (the record completed or given up meanwhile) is no
		// loss.
		return
	}
	switch {
	case err == nil:
		run.extend(until)
	case errors.Is(err, ErrLeaseLost):
		run.cancelWork(ErrLeaseLost)
		return
	case run.expiring(time.Now(), third):
		run.cancelWork(fmt.Errorf("%w: %w", errLeaseExpired, err))
		return
	}
	// Fixed rate from the beat's start, so that a slow beat does not eat
	// into the margin; never a busy loop on a slow store.
	next := max(third-time.Since(start), third/10)
	hb.mu.Lock()
	if !hb.stopped {
		hb.timer.Reset(next)
	}
	hb.mu.Unlock()
}
