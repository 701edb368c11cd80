package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"
)

// heartbeat extends a run's lease every lease/3 while its handler runs. It
// is a timer (time.AfterFunc), not a goroutine: nothing runs between beats,
// and stop does not wait unless a beat is in flight.
type heartbeat struct {
	h      *handler
	run    *Run
	bg     context.Context
	cancel context.CancelCauseFunc

	mu       sync.Mutex
	timer    *time.Timer
	stopped  bool
	inFlight sync.WaitGroup // a beat that started before stop
}

// startHeartbeat starts hb, the heartbeat of run: a beat every lease/3 until
// stopped; a lost lease cancels the handler's context with cause
// ErrLeaseLost, and failures that last until less than lease/3 of the lease
// is left cancel it with cause ErrLeaseExpired (and mark the run expired).
func (h *handler) startHeartbeat(hb *heartbeat, bg context.Context, run *Run, cancel context.CancelCauseFunc) *heartbeat {
	hb.h, hb.run, hb.bg, hb.cancel = h, run, bg, cancel
	hb.mu.Lock() // the first beat reschedules through hb.timer: set it first
	hb.timer = time.AfterFunc(h.cfg.lease/3, hb.beat)
	hb.mu.Unlock()
	return hb
}

// stop ends the heartbeat: no beat starts after it, and a beat still in
// flight (say, on SQLite, waiting for the write lock that the request's own
// unit holds until finish commits it) has no effect when it returns. stop
// does not wait for it: waiting could stall the request for the store's busy
// timeout behind its own lock.
func (hb *heartbeat) stop() {
	hb.mu.Lock()
	defer hb.mu.Unlock()
	hb.stopped = true
	hb.timer.Stop()
}

// settle waits for a beat still in flight after stop. Call it once nothing
// of the request holds a lock a beat may wait for (its unit rolled back),
// before ending the lease at once: a late beat would extend it again.
func (hb *heartbeat) settle() { hb.inFlight.Wait() }

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
	h, run, bg := hb.h, hb.run, hb.bg
	lease := run.Lease
	interval := h.cfg.lease / 3
	margin := h.cfg.lease / 3
	if !hb.begin() {
		return
	}
	defer hb.inFlight.Done()
	start := h.cfg.now()
	// Half the margin: a beat that hangs gives up while the lease
	// still has time left for the next one.
	ctx, c := context.WithTimeout(bg, margin/2)
	until := start.Add(h.cfg.lease)
	t0 := time.Now()
	err := h.store.Heartbeat(ctx, lease, until)
	c()
	h.storeCall(bg, OpHeartbeat, lease.Scope, t0, err)
	if hb.isStopped() {
		return // the handler is done: this late beat changes nothing
	}
	if err == nil {
		run.extend(until)
	}
	if errors.Is(err, ErrLeaseLost) {
		h.log(bg, slog.LevelWarn, "idempotency: lease lost while the handler ran; canceling it", lease.Scope,
			"generation", lease.Generation)
		hb.cancel(ErrLeaseLost)
		return
	}
	if err != nil && run.expiring(h.cfg.now(), margin) {
		h.log(bg, slog.LevelError, "idempotency: heartbeats failed and the lease is about to run out; canceling the handler (its work is completed only if no successor took over)",
			lease.Scope, "err", err, "generation", lease.Generation)
		hb.cancel(ErrLeaseExpired)
		return
	}
	if err != nil {
		h.log(bg, slog.LevelWarn, "idempotency: heartbeat failed", lease.Scope, "err", err)
	}
	// Fixed rate from the beat's start, so that a slow beat does not
	// eat into the margin; never a busy loop on a slow store.
	next := max(interval-h.cfg.now().Sub(start), interval/10)
	hb.mu.Lock()
	if !hb.stopped {
		hb.timer.Reset(next)
	}
	hb.mu.Unlock()
}
