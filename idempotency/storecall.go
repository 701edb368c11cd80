package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// storeTimeout bounds each store call the library makes on its own behalf
// (call), and the wait for a unit of work to begin (begin).
const storeTimeout = 10 * time.Second

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
func (m *Middleware) call(ctx context.Context, op Op, s Scope, f func(ctx context.Context) error) error {
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

// errBeginTimeout ends the wait of begin.
var errBeginTimeout = fmt.Errorf("idempotency: the store did not begin a unit of work within %v: %w",
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
