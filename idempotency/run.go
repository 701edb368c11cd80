package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/saferetry/saferetry/keygen"
)

// Run is the execution of a guarded request that owns its record: the
// middleware (and the Completer) puts it on the handler's context, where
// FromContext finds it. Its methods are safe for concurrent use, but phases
// run one at a time. After the handler returns, Unit, Phase and External
// fail with ErrMisuse.
type Run struct {
	// Scope is the record's scope (principal, method, route, key).
	// Scope.Principal is what WithPrincipal's function returned for the
	// client's request: the way a handler learns its caller, live and on a
	// resume by the Completer alike (a resumed request carries no
	// credentials).
	Scope Scope
	// Lease is the owner token and fencing generation of this execution.
	Lease Lease
	// RecoveryPoint is the record's recovery point at the claim: "" for a
	// new request, the last committed phase when this execution took over
	// one whose owner's lease expired.
	RecoveryPoint string
	// Payload is the Call.Payload of a call of Do, live and on a resume by
	// the Completer alike; nil for a request, whose handler reads its
	// body. It is shared: do not modify it.
	Payload []byte

	m            *Middleware
	recoveryData []byte // the record's at the claim
	oneTx        bool   // Phase and External fail with ErrOneTransaction
	// bg is request.bg: the execution's store calls, and its units, use it.
	bg     context.Context
	cancel context.CancelCauseFunc // cancels the work's context: only cancelWork calls it

	beginMu sync.Mutex // held by Unit while it begins the request's unit

	mu         sync.Mutex
	leaseUntil time.Time
	beginning  bool      // Unit is beginning the request's unit
	unit       *openUnit // the request's unit, once begun
	unitErr    error     // Begin's error, kept for the completion
	done       bool      // the handler returned
	expired    bool      // the lease ran out while heartbeats failed: no new phase may start
	inPhase    bool
	phase      string    // the running phase's name, while inPhase
	rec        *recovery // decoded lazily from recoveryData
	point      string    // the current recovery point
	seen       map[string]bool
}

// newRun returns the Run of an execution that created or took over
// res.Record.
func (m *Middleware) newRun(req request, res ClaimResult) *Run {
	rec := res.Record
	run := &Run{
		Scope: req.scope, Lease: Lease{Scope: req.scope, Owner: rec.Owner,
			Generation: rec.Generation},
		RecoveryPoint: rec.RecoveryPoint, Payload: req.payload(), m: m,
		recoveryData: rec.RecoveryData, bg: req.bg,
		leaseUntil: rec.LeaseUntil, point: rec.RecoveryPoint,
		unit: res.unit, // the unit of a claim in one transaction, else begun by Unit
		// A takeover resumes a record left in progress, perhaps before the
		// route had the option: its phases run, so that it completes.
		oneTx: m.cfg.oneTx && res.Outcome != ClaimTakenOver,
	}
	return run
}

// ErrMisuse is matched by the errors of a Run used in a way that cannot be
// made safe: after its handler returned, or with phases out of their rules
// (see Run.Phase).
var ErrMisuse = errors.New("idempotency: misuse of a run")

// ErrOneTransaction is matched by the *PhaseError of Phase and External
// on a Middleware made WithOneTransaction(true), but in an execution that
// took over a record in progress: phases and External calls need records
// in progress with committed recovery points, which one transaction does
// not have. It matches ErrMisuse too.
var ErrOneTransaction = fmt.Errorf(
	"%w: phases and External calls need the multi-step lifecycle, not WithOneTransaction",
	ErrMisuse)

// errLeaseExpired is the cause with which the middleware cancels a
// handler's context when no heartbeat got through (the store unreachable)
// until a sixth of the lease was left: the margin for the servers' clocks,
// past which a retry or the Completer may take the record over, so the
// first execution must stop (see heartbeat). Phase and External then fail
// with it; what the handler did before is still completed, fenced, when it
// returns.
var errLeaseExpired = fmt.Errorf("%w: it ran out while heartbeats failed", ErrLeaseLost)

// Unit returns the unit of work in which the handler's writes at ctx
// belong, and a context with ctx's deadline and cancellation that carries
// the store's transaction (sqlstore.Tx calls Unit itself):
//
//   - inside a phase (ctx derives from the one Phase gave its function):
//     the phase's unit, which commits with its recovery point;
//   - elsewhere: the request's unit, which commits with the stored
//     response, or not at all. It is begun on the first call, so that a
//     handler holds no transaction while it works; begin it after the last
//     phase, since phases cannot start once it is open.
//
// The handler must not Commit or Roll back either unit. Errors: one
// wrapping errors.ErrUnsupported when the store is not a Transactor;
// ErrMisuse after the handler returned, and a *PhaseError (Step "use") when
// asked for the request's unit with another context while a phase runs;
// the store's Begin error, after which the request answers 503
// CodeStoreUnavailable whatever the handler writes.
func (r *Run) Unit(ctx context.Context) (Unit, context.Context, error) {
	if p, ok := ctx.Value(phaseKey{}).(*phaseCtx); ok && p.run == r && p.unit != nil {
		return p.unit.Unit, mergeValues(ctx, p.unit.ctx), nil
	}
	if r.m.g.tx == nil && r.unit == nil { // r.unit: set by a claim in one transaction alone
		return nil, ctx, fmt.Errorf("idempotency: the store has no units of work "+
			"(not a Transactor): %w", errors.ErrUnsupported)
	}
	// One Unit call at a time begins the unit, without holding r.mu while
	// the store begins it: a heartbeat and the phases' checks go on.
	r.beginMu.Lock()
	defer r.beginMu.Unlock()
	r.mu.Lock()
	switch {
	case r.done:
		r.mu.Unlock()
		return nil, ctx, errRunDone
	case r.inPhase:
		// ctx is not the phase's: the request's unit would take the
		// phase's writes out of the phase.
		r.mu.Unlock()
		return nil, ctx, &PhaseError{Phase: r.phase, Step: "use", Err: fmt.Errorf(
			"%w: the request's unit asked for while phase %q runs; "+
				"use the context the phase gave its function", ErrMisuse, r.phase)}
	case r.unitErr != nil:
		r.mu.Unlock()
		return nil, ctx, r.unitErr
	case r.unit != nil:
		r.mu.Unlock()
		return r.unit.Unit, mergeValues(ctx, r.unit.ctx), nil
	}
	r.beginning = true // no phase may start from now on
	r.mu.Unlock()

	u, err := r.m.g.begin(r.bg, r.Lease)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.beginning = false
	switch {
	case err != nil:
		r.unitErr = err
		return nil, ctx, err
	case r.done:
		// The handler returned while the unit began (Unit was called by
		// a goroutine of its own): the completion never sees this unit.
		r.m.g.end(r.bg, u)
		return nil, ctx, errRunDone
	}
	r.unit = u
	return u.Unit, mergeValues(ctx, u.ctx), nil
}

var errRunDone = fmt.Errorf("%w: the handler of this run has returned", ErrMisuse)

// close marks the run done and hands the request's unit and Begin's error
// to the completion: the unit of the store's that Unit began, else an
// auto-commit unit.
func (r *Run) close() (*openUnit, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done = true
	if r.unit == nil {
		return r.m.g.autoCommit(r.Lease), r.unitErr
	}
	return r.unit, r.unitErr
}

// cancelWork cancels the work's context with cause: the one place that
// does, whether the lease was lost, the shutdown came, or the execution
// ended (nil).
func (r *Run) cancelWork(cause error) {
	if r.cancel != nil {
		r.cancel(cause)
	}
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

// leaseEnd returns the end of the lease as the run last extended it.
func (r *Run) leaseEnd() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.leaseUntil
}

// extend records a successful heartbeat.
func (r *Run) extend(until time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if until.After(r.leaseUntil) {
		r.leaseUntil = until
	}
}

// DownstreamKey returns the idempotency key this execution uses towards
// another service for phase: keygen.Event of phase and a digest of the
// client's key scope, the first 16 bytes of SHA-256 over the
// length-prefixed principal, method, route (for Do: none, and the
// operation) and client's key. So it carries the client's key in digest
// form: the same in every execution under that key (a retry after the key
// was given up, a takeover and a resume alike), and another one for
// another client key, principal, operation, route or method: a client
// that sends the same request under a new key makes a new downstream call. The client's key
// itself is never in it, so it never reaches the other service or its
// logs. External passes it to its call; use it for any other downstream
// call that can de-duplicate. It is a valid bare key (keygen.Validate).
func (r *Run) DownstreamKey(phase string) string {
	s := r.Scope
	h := sha256.New()
	for _, part := range [...]string{s.Principal, s.Method, s.Route, s.Key} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return keygen.Event(phase, hex.EncodeToString(h.Sum(nil)[:16]))
}

type runKey struct{}

// FromContext returns the Run of the guarded request whose context ctx
// derives from, and false outside a guarded execution.
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
