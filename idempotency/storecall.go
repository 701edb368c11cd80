package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// storeTimeout bounds each store call the library makes on its own behalf
// (call), the wait for a unit of work to begin (begin), and the tries of a
// fenced write (fenced) and of the read that settles its outcome.
const storeTimeout = 10 * time.Second

// The pauses between the tries of a fenced write: 20 ms, doubled after
// each try, at most a second.
const (
	firstRetryPause = 20 * time.Millisecond
	maxRetryPause   = time.Second
)

// storeCtx returns the context of a store call the library makes on its own
// behalf: ctx, with at most storeTimeout left, so that a hung store (a lock,
// a network partition, an exhausted pool) never stops a request or a job
// for good. Callers that must outlive their client pass a context without
// its cancellation.
func storeCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, storeTimeout)
}

// call makes one store call on the library's own behalf: f, on ctx with at
// most storeTimeout left, reported to the observers as op on s (the zero
// Scope for a call about no single record). Every store call of the
// middleware, its Completer and its Reaper goes through call or begin.
func (m *Middleware) call(ctx context.Context, op Op, s Scope,
	f func(ctx context.Context) error) error {
	sctx, cancel := storeCtx(ctx)
	defer cancel()
	start := time.Now()
	err := f(sctx)
	m.obs.storeCall(ctx, op, s, start, err)
	return err
}

// get reads s's record (OpGet).
func (m *Middleware) get(ctx context.Context, s Scope) (Record, error) {
	var rec Record
	err := m.call(ctx, OpGet, s, func(ctx context.Context) error {
		var err error
		rec, err = m.store.Get(ctx, s)
		return err
	})
	return rec, err
}

// claim claims c.Scope (OpClaim).
func (m *Middleware) claim(ctx context.Context, c Claim) (ClaimResult, error) {
	var res ClaimResult
	err := m.call(ctx, OpClaim, c.Scope, func(ctx context.Context) error {
		var err error
		res, err = m.store.Claim(ctx, c)
		return err
	})
	return res, err
}

// isAnswer reports whether err is one of the store's answers, not a failure
// of the call: trying again would get it again.
func isAnswer(err error) bool {
	return errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotFound) ||
		errors.Is(err, ErrStoreFull) || errors.Is(err, ErrRecordTooLarge)
}

// retry runs try until it succeeds or returns one of the store's answers,
// pausing between tries (20 ms, doubled, at most 1 s), for at most
// storeTimeout: a store that dropped the connection a call ran on (a
// restart, a failover, a terminated backend) answers the next try on a
// fresh one. It returns the last error and whether a try failed with an
// error that leaves the call's outcome unknown (not an answer).
func retry(ctx context.Context, try func(ctx context.Context) error) (err error, unknown bool) {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	pause := firstRetryPause
	for {
		if err = try(ctx); err == nil || isAnswer(err) {
			return err, unknown
		}
		unknown = true
		if wait.Sleep(ctx, pause) != nil {
			return err, unknown
		}
		pause = min(2*pause, maxRetryPause)
	}
}

// fenced makes f, a write of l's record outside any unit (Complete,
// SetRecoveryPoint, EndLease, Release), as op, and tries it again on a
// failure that is not one of the store's answers (retry): the write is
// conditional on the owner and generation of l, so a repeat of one that
// applied changes nothing, or fails with ErrLeaseLost when the write ended
// the record's progress. For such a write, applied, when set, reads the
// record after an ErrLeaseLost that followed a failed try, and tells
// whether that try applied (then fenced returns nil).
func (m *Middleware) fenced(ctx context.Context, op Op, l Lease, f func(ctx context.Context) error,
	applied func(rec Record, err error) bool) error {
	err, unknown := retry(ctx, func(rctx context.Context) error {
		return m.call(rctx, op, l.Scope, f)
	})
	if unknown && applied != nil && errors.Is(err, ErrLeaseLost) &&
		m.applied(ctx, l.Scope, applied) {
		return nil
	}
	return err
}

// commit makes the writes of u (write, then Commit) as op. When Commit
// fails with an error that is not ErrLeaseLost, whether it applied is the
// database's to say (the connection dropped after the COMMIT went out,
// say): applied reads the record, whose owner and generation tell whose
// commit it holds, and commit returns nil when it is u's.
func (m *Middleware) commit(ctx context.Context, op Op, l Lease, u Unit,
	write func(ctx context.Context) error, applied func(rec Record, err error) bool) error {
	committing := false
	err := m.call(ctx, op, l.Scope, func(ctx context.Context) error {
		if err := write(ctx); err != nil {
			return err
		}
		committing = true
		return u.Commit()
	})
	if err != nil && committing && !errors.Is(err, ErrLeaseLost) &&
		m.applied(ctx, l.Scope, applied) {
		return nil
	}
	return err
}

// applied reads s's record, trying again within storeTimeout while the
// store fails, and returns what applied says of it (false when it cannot
// be read).
func (m *Middleware) applied(ctx context.Context, s Scope,
	applied func(rec Record, err error) bool) bool {
	var rec Record
	err, _ := retry(ctx, func(rctx context.Context) error {
		var err error
		rec, err = m.get(rctx, s)
		return err
	})
	if err != nil && !errors.Is(err, ErrNotFound) {
		return false
	}
	return applied(rec, err)
}

// ownedBy reports whether rec is held by l: its owner and generation.
func ownedBy(rec Record, l Lease) bool {
	return rec.Owner == l.Owner && rec.Generation == l.Generation
}

// errBeginTimeout ends the wait of begin.
var errBeginTimeout = fmt.Errorf(
	"idempotency: the store did not begin a unit of work within %v: %w",
	storeTimeout, context.DeadlineExceeded)

// begin begins a unit of work for l on ctx without its cancellation
// (OpBegin), waiting at most storeTimeout for the store to begin it. The
// unit lives until its Commit or rollback, however long the work in it
// takes, so its context (which a SQL transaction keeps for its whole life)
// is not given a deadline: a timer cancels it only while Begin has not
// returned.
func (m *Middleware) begin(ctx context.Context, l Lease) (Unit, context.Context, error) {
	start := time.Now()
	bctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	timer := time.AfterFunc(storeTimeout, func() { cancel(errBeginTimeout) })
	u, uctx, err := m.tx.Begin(bctx, l)
	late := !timer.Stop() // the wait ran out: bctx is canceled, and the unit with it
	if late {
		err = errBeginTimeout
	}
	m.obs.storeCall(ctx, OpBegin, l.Scope, start, err)
	if late {
		if u != nil {
			m.rollback(ctx, l.Scope, u)
		}
		return nil, ctx, err
	}
	return u, uctx, err
}

// rollback discards u, a unit that will not commit (OpRollback): the one
// way the library ends a unit other than by committing it.
func (m *Middleware) rollback(ctx context.Context, s Scope, u Unit) {
	start := time.Now()
	err := u.Rollback()
	m.obs.storeCall(ctx, OpRollback, s, start, err)
}

// every runs f in a goroutine at once and then again after the pause f
// returns, until ctx ends or stop is called; stop cancels f's context and
// waits for the goroutine to return. It runs the Completer and the Reaper.
func every(ctx context.Context, f func(ctx context.Context) (pause time.Duration)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if wait.Sleep(ctx, f(ctx)) != nil {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}
