package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
)

// Run describes the execution of a guarded request that owns its record.
// The middleware (and the Completer) puts it on the handler's request
// context; FromContext returns it. Its methods are safe for concurrent use,
// but phases run one at a time (see Phase). The handler must not use it after
// returning: Unit, Phase and External then fail with ErrRunDone.
type Run struct {
	// Scope is the record's scope (principal, method, route, key).
	Scope Scope
	// Lease is the owner token and fencing generation of this execution.
	Lease Lease
	// RecoveryPoint and RecoveryData are the record's recovery point at the
	// claim: "" and nil for a new request, the last committed phase when this
	// execution took over a record whose previous owner's lease expired.
	// They do not change while the handler runs; Phase and External read
	// and extend them (DecodeRecovery reads the data they write).
	RecoveryPoint string
	RecoveryData  []byte

	// What the phases and the unit need. The middleware's own parts of an
	// execution (heartbeat, response capture, request body) are not here:
	// the Run is reachable from the handler's context, which may outlive the
	// request.
	store    Store
	tx       Transactor
	bg       context.Context // not canceled with the client: the request unit lives in it
	now      func() time.Time
	leaseFor time.Duration
	execID   string                  // StoredRequest.ID: the base of downstream keys
	created  time.Time               // the record's CreatedAt: the fallback base without an ID
	cancel   context.CancelCauseFunc // cancels the handler's context

	mu         sync.Mutex
	leaseUntil time.Time
	unit       Unit            // the request's unit, once begun
	unitCtx    context.Context // Begin's context for unit
	unitErr    error           // Begin's error, kept for the completion
	done       bool            // the handler returned
	expired    bool            // the lease ran out while heartbeats failed: no new phase may start
	inPhase    bool
	phase      string    // the running phase's name, while inPhase
	rec        *Recovery // decoded lazily from RecoveryData
	point      string    // the current recovery point
	seen       map[string]bool
}

// ErrNoTransactor is returned by Run.Unit when the store does not implement
// Transactor.
var ErrNoTransactor = errors.New("idempotency: the store has no units of work (not a Transactor)")

// ErrRunDone is returned by Run.Unit, Run.Phase and Run.External called after
// the handler returned.
var ErrRunDone = errors.New("idempotency: the handler of this run has returned")

// ErrLeaseExpired is the cause with which the middleware cancels a handler's
// context when its heartbeats kept failing (the store unreachable) and the
// lease it last extended is about to run out (less than a third of the
// lease left): past that point a retry or the Completer may take the record
// over and run the request a second time, so the first execution must stop.
// Phase and External then fail with it (Op "lease"); what the handler did
// before is still completed when it returns, fenced on owner and generation,
// so that it stands if no successor took over and is rejected if one did.
// It matches ErrLeaseLost too (errors.Is): the execution can no longer
// count on owning its record.
var ErrLeaseExpired = fmt.Errorf("%w: it ran out while heartbeats failed", ErrLeaseLost)

// Unit returns the unit of work in which the handler's own writes at ctx
// belong, and a context with ctx's deadline and cancellation that also
// carries the store's transaction (for the SQL store, sqlstore.Tx reads it;
// sqlstore.Tx(ctx) calls Unit itself, so handlers of the SQL store rarely
// need this method):
//
//   - inside a phase (ctx is, or derives from, the context Phase gave its
//     function): the phase's unit, which commits with the phase's recovery
//     point;
//   - elsewhere: the request's unit, which commits together with the stored
//     response, or not at all. It is begun on the first call, not before the
//     handler runs, so that a handler that never asks holds no transaction
//     (on SQLite, no write lock) while it works or calls other services.
//     Begin it after the last phase: once it is open, Phase and External
//     fail with ErrPhaseMisuse (on SQLite a phase's own unit would wait for
//     the lock the request's unit holds).
//
// While a phase runs, asking with a context that is not the phase's (the
// handler's own, say, captured outside the phase's function) is a
// *PhaseError with Op "use" wrapping ErrPhaseMisuse: it would put the
// phase's writes in the request's unit. It opens nothing, so the request's
// unit can still be begun after the phase. (sqlstore.Tx then returns
// false.)
//
// The handler must not Commit or Roll back either unit. Errors:
// ErrNoTransactor, ErrRunDone, that *PhaseError, or the store's Begin error; after a failed
// Begin the request answers 503 CodeStoreUnavailable whatever the handler
// writes (phases already committed stay, and a retry resumes after them).
func (r *Run) Unit(ctx context.Context) (Unit, context.Context, error) {
	if p, ok := ctx.Value(phaseKey{}).(*phaseCtx); ok && p.run == r && p.unit != nil {
		return p.unit, mergeValues(ctx, p.ctx), nil
	}
	if r.tx == nil {
		return nil, ctx, ErrNoTransactor
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.done:
		return nil, ctx, ErrRunDone
	case r.inPhase:
		// ctx is not the phase's: the request's unit would take the
		// phase's writes out of the phase (they would commit, or roll
		// back, with the response instead of with the recovery point).
		return nil, ctx, &PhaseError{Phase: r.phase, Op: "use", Err: fmt.Errorf(
			"%w: the request's unit asked for while phase %q runs; use the context the phase gave its function", ErrPhaseMisuse, r.phase)}
	case r.unitErr != nil:
		return nil, ctx, r.unitErr
	case r.unit == nil:
		u, uctx, err := r.tx.Begin(r.bg, r.Lease)
		if err != nil {
			r.unitErr = err
			return nil, ctx, err
		}
		r.unit, r.unitCtx = u, uctx
	}
	return r.unit, mergeValues(ctx, r.unitCtx), nil
}

// close marks the run done and hands the request's unit (nil if never
// begun) and Begin's error to the completion.
func (r *Run) close() (Unit, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done = true
	return r.unit, r.unitErr
}

// currentPoint returns the recovery point as of the last committed phase.
func (r *Run) currentPoint() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.point
}

// expiring reports whether the lease the run last extended ends within
// margin of now (now >= leaseUntil - margin), and if so marks the run
// expired: no phase may start after that.
func (r *Run) expiring(now time.Time, margin time.Duration) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Before(r.leaseUntil.Add(-margin)) {
		return false
	}
	r.expired = true
	return true
}

// extend records a successful heartbeat.
func (r *Run) extend(until time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if until.After(r.leaseUntil) {
		r.leaseUntil = until
	}
}

// DownstreamKey returns the idempotency key that this request's phase uses
// towards another service: keygen.Event(key, phase, id), where id is a
// random identifier minted when the record was claimed (StoredRequest.ID).
// It is the same in every execution of the request (a takeover keeps it)
// and differs between principals, routes and methods that reuse a key, and
// for a key reused after the replay window (a new request). External passes
// it to its call; use it yourself for any other downstream call that can
// de-duplicate. The result is always a valid bare key (keygen.Validate).
//
// A record whose stored request has no ID (written by something other than
// the middleware) falls back to a digest of the scope and the record's
// CreatedAt (Unix nanoseconds), which a takeover keeps and a claim after
// the replay window renews: still the same in every execution of one
// request, and new for a key reused after the window.
func (r *Run) DownstreamKey(phase string) string {
	id := r.execID
	if id == "" {
		sum := sha256.Sum256([]byte(r.Scope.Principal + "\x00" + r.Scope.Method + "\x00" + r.Scope.Route + "\x00" + r.Scope.Key +
			"\x00" + strconv.FormatInt(r.created.UnixNano(), 10)))
		id = hex.EncodeToString(sum[:8])
	}
	return downstreamKey(r.Scope.Key, phase, id)
}

type runKey struct{}

// FromContext returns the Run of the guarded request whose context ctx is
// (or derives from), and false outside a guarded execution (pass-through,
// replays and conflicts never reach the handler).
func FromContext(ctx context.Context) (*Run, bool) {
	r, ok := ctx.Value(runKey{}).(*Run)
	return r, ok
}

// withRun returns ctx carrying r, which FromContext finds.
func withRun(ctx context.Context, r *Run) context.Context {
	return context.WithValue(ctx, runKey{}, r)
}

// valuesCtx has the deadline and cancellation of its Context and looks values
// up in vals first: a unit's context (begun in a context that is not
// canceled with the request) merged with the caller's.
type valuesCtx struct {
	context.Context
	vals context.Context
}

func (c valuesCtx) Value(key any) any {
	if v := c.vals.Value(key); v != nil {
		return v
	}
	return c.Context.Value(key)
}

func mergeValues(ctx, vals context.Context) context.Context {
	if vals == nil || vals == ctx {
		return ctx
	}
	return valuesCtx{Context: ctx, vals: vals}
}
