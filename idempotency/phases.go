package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/saferetry/saferetry/keygen"
)

// RecoveryVersion is the version of the RecoveryData format that Phase and
// External write (Recovery.Encode).
const RecoveryVersion = 1

// maxPhaseName is the longest phase name, in bytes.
const maxPhaseName = 128

// Recovery is the decoded RecoveryData that Phase and External keep in the
// record: the committed phases in order and, at most one at a time, an
// external call whose intent is recorded but whose outcome is not. It is
// versioned JSON (RecoveryVersion); outputs are base64 in it.
type Recovery struct {
	Phases  []CommittedPhase `json:"phases,omitempty"`
	Pending *PendingCall     `json:"pending,omitempty"`
}

// CommittedPhase is a phase whose work committed: its output is returned
// again, without running it, to every later execution.
type CommittedPhase struct {
	Name          string `json:"name"`
	Output        []byte `json:"output,omitempty"`
	DownstreamKey string `json:"downstream_key,omitempty"` // set for an External phase
}

// PendingCall is the intent of an External phase: recorded before the call,
// cleared when its outcome commits. Found by a later execution, it means the
// call may or may not have reached the other service.
type PendingCall struct {
	Phase         string `json:"phase"`
	DownstreamKey string `json:"downstream_key"`
}

type recoveryWire struct {
	Version int `json:"v"`
	Recovery
}

// ErrBadRecoveryData is matched by the error of DecodeRecovery for bytes that
// are not RecoveryData written by Phase and External (and so by the
// *PhaseError of a phase that meets such a record).
var ErrBadRecoveryData = errors.New("idempotency: malformed recovery data")

// Encode returns the RecoveryData form of rec (versioned JSON).
func (rec Recovery) Encode() []byte {
	b, _ := json.Marshal(recoveryWire{Version: RecoveryVersion, Recovery: rec}) // strings and bytes only
	return b
}

// DecodeRecovery decodes RecoveryData written by Phase and External. Empty
// data decodes to an empty Recovery. Errors wrap ErrBadRecoveryData: invalid
// JSON, another version, an empty or repeated phase name, or a pending call
// for a committed phase.
func DecodeRecovery(data []byte) (Recovery, error) {
	if len(data) == 0 {
		return Recovery{}, nil
	}
	var w recoveryWire
	if err := json.Unmarshal(data, &w); err != nil {
		return Recovery{}, errors.Join(ErrBadRecoveryData, err)
	}
	if w.Version != RecoveryVersion {
		return Recovery{}, fmt.Errorf("%w: version %d, want %d", ErrBadRecoveryData, w.Version, RecoveryVersion)
	}
	seen := make(map[string]bool, len(w.Phases))
	for _, p := range w.Phases {
		if p.Name == "" || seen[p.Name] {
			return Recovery{}, fmt.Errorf("%w: empty or repeated phase name %q", ErrBadRecoveryData, p.Name)
		}
		seen[p.Name] = true
	}
	if w.Pending != nil && (w.Pending.Phase == "" || seen[w.Pending.Phase]) {
		return Recovery{}, fmt.Errorf("%w: pending call for phase %q", ErrBadRecoveryData, w.Pending.Phase)
	}
	return w.Recovery, nil
}

// committed returns the saved output of a committed phase.
func (rec Recovery) committed(name string) ([]byte, bool) {
	for _, p := range rec.Phases {
		if p.Name == name {
			return p.Output, true
		}
	}
	return nil, false
}

// with returns a copy of rec with phase p committed and no pending call.
func (rec Recovery) with(p CommittedPhase) Recovery {
	phases := make([]CommittedPhase, 0, len(rec.Phases)+1)
	phases = append(phases, rec.Phases...)
	return Recovery{Phases: append(phases, p)}
}

// intentPrefix starts the recovery point of a recorded intent.
const intentPrefix = "intent:"

// intentPoint is the recovery point of a recorded intent.
func intentPoint(phase string) string { return intentPrefix + phase }

func downstreamKey(key, phase, id string) string { return keygen.Event(key, phase, id) }

// ErrPhaseMisuse is matched by the errors of Phase and External called in a
// way that cannot be made safe: an empty, too long (over 128 bytes) or
// repeated phase name, a nil function, a phase inside a phase, two phases at
// once, a phase after the request's unit was begun (Run.Unit), the
// request's unit asked for (Run.Unit, sqlstore.Tx) with a context other than
// the phase's while a phase runs, or a new phase while the outcome of
// another External phase is unknown (call External for that one first).
var ErrPhaseMisuse = errors.New("idempotency: phase misuse")

// PhaseError reports a phase that did not commit. Op is where it stopped:
// "use" (misuse, wraps ErrPhaseMisuse or ErrRunDone), "decode" (the record's
// recovery data, wraps ErrBadRecoveryData), "lease" (the lease was lost
// before the phase started, wraps ErrLeaseLost, or ErrLeaseExpired after
// heartbeats failed), "begin" (the store's
// Begin), "run" (the phase's function returned Err), "intent" (recording an
// External phase's intent), "lookup" and "call" (an External phase's
// functions returned Err; the intent stays recorded) or "commit". A lost
// lease at "intent" or "commit" wraps ErrLeaseLost: a successor owns the
// record and nothing of this phase committed.
type PhaseError struct {
	Phase string
	Op    string
	Err   error
}

// Error returns "idempotency: phase <name>: <op>: <cause>".
func (e *PhaseError) Error() string {
	return fmt.Sprintf("idempotency: phase %q: %s: %v", e.Phase, e.Op, e.Err)
}

// Unwrap returns the cause.
func (e *PhaseError) Unwrap() error { return e.Err }

type phaseKey struct{}

// phaseCtx marks the context of a running phase.
type phaseCtx struct {
	run  *Run
	unit Unit            // nil when the store is not a Transactor
	ctx  context.Context // Begin's context
}

// enter starts phase name: it checks the rules of ErrPhaseMisuse, decodes
// the recovery data once and returns the current Recovery. On success the
// caller must call leave.
func (r *Run) enter(ctx context.Context, name string, external bool) (Recovery, error) {
	misuse := func(format string, a ...any) (Recovery, error) {
		return Recovery{}, &PhaseError{Phase: name, Op: "use", Err: fmt.Errorf("%w: "+format, append([]any{ErrPhaseMisuse}, a...)...)}
	}
	if p, ok := ctx.Value(phaseKey{}).(*phaseCtx); ok && p.run == r {
		return misuse("called inside another phase")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.done:
		return Recovery{}, &PhaseError{Phase: name, Op: "use", Err: ErrRunDone}
	case r.expired:
		return Recovery{}, &PhaseError{Phase: name, Op: "lease", Err: ErrLeaseExpired}
	case name == "" || len(name) > maxPhaseName:
		return misuse("a phase name has 1 to %d bytes", maxPhaseName)
	case r.inPhase:
		return misuse("another phase is running")
	case r.unit != nil || r.unitErr != nil:
		return misuse("the request's unit of work is open; run phases before using it")
	case r.seen[name]:
		return misuse("phase name used twice in one execution")
	}
	if r.rec == nil {
		rec, err := DecodeRecovery(r.RecoveryData)
		if err != nil {
			return Recovery{}, &PhaseError{Phase: name, Op: "decode", Err: err}
		}
		r.rec = &rec
	}
	rec := *r.rec
	if _, done := rec.committed(name); !done && rec.Pending != nil && (rec.Pending.Phase != name || !external) {
		return misuse("the outcome of external phase %q is unknown; call External(%q) first", rec.Pending.Phase, rec.Pending.Phase)
	}
	if r.seen == nil {
		r.seen = make(map[string]bool)
	}
	r.seen[name] = true
	r.inPhase, r.phase = true, name
	return rec, nil
}

func (r *Run) leave() {
	r.mu.Lock()
	r.inPhase, r.phase = false, ""
	r.mu.Unlock()
}

// saved records a commit of the recovery data.
func (r *Run) saved(rec Recovery, point string) {
	r.mu.Lock()
	r.rec, r.point = &rec, point
	r.mu.Unlock()
}

// storeCtx is the context of the record writes of a phase: they go on when
// the client goes away (the work is done; recording it is what makes a retry
// safe), bounded by storeTimeout.
func storeCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
}

// lost cancels the handler when a write found the lease lost.
func (r *Run) lost(err error) {
	if errors.Is(err, ErrLeaseLost) && r.cancel != nil {
		r.cancel(ErrLeaseLost)
	}
}

// checkLease makes sure the run still owns its record before work that
// matters: when the lease it last extended has run out (a stalled process),
// it renews it with a conditional heartbeat, which fails with ErrLeaseLost
// if a successor took the record over. force renews it in any case.
func (r *Run) checkLease(ctx context.Context, force bool) error {
	r.mu.Lock()
	until := r.leaseUntil
	r.mu.Unlock()
	now := r.now()
	if !force && now.Before(until) {
		return nil
	}
	sctx, cancel := storeCtx(ctx)
	defer cancel()
	next := now.Add(r.leaseFor)
	if err := r.store.Heartbeat(sctx, r.Lease, next); err != nil {
		r.lost(err)
		return err
	}
	r.extend(next)
	return nil
}

// Phase runs fn as the atomic phase name and returns its output; a phase
// that committed in an earlier execution of this request is not run again:
// Phase returns the output it saved.
//
// With a store that implements Transactor, fn runs in a unit of work of its
// own: the context it gets carries the unit's transaction (for the SQL store
// sqlstore.Tx(ctx) returns it; Run.Unit(ctx) returns the unit), and its
// writes commit together with the record's new recovery point (name) and
// fn's output, or not at all: when fn returns an error or panics, or when
// the lease was lost (a fenced owner cannot commit a phase; the commit fails
// with ErrLeaseLost and the handler's context is canceled with that cause).
// With a plain Store, fn's writes are its own business and only the
// recovery point is recorded after it returns.
//
// fn must be deterministic in what it commits, and must not call other
// services that cannot be rolled back (use External for those). Phases
// must come in the same order in every execution of a request, with names
// unique within it, one at a time and before the request's unit is begun.
// Keep outputs small (they are stored in the record, base64 in JSON).
//
// Errors are *PhaseError: Op "run" wraps fn's own error (errors.Is and
// errors.As reach it); see PhaseError and ErrPhaseMisuse for the others.
// After an error nothing of the phase committed and the handler should
// answer with a status that is not stored (5xx): the middleware keeps the
// record in progress with its recovery point and ends its lease at once, so
// that a retry (or the Completer) resumes.
func (r *Run) Phase(ctx context.Context, name string, fn func(ctx context.Context) ([]byte, error)) ([]byte, error) {
	rec, err := r.enter(ctx, name, false)
	if err != nil {
		return nil, err
	}
	defer r.leave()
	if out, ok := rec.committed(name); ok {
		return out, nil
	}
	if fn == nil {
		return nil, &PhaseError{Phase: name, Op: "use", Err: fmt.Errorf("%w: nil function", ErrPhaseMisuse)}
	}
	if err := r.checkLease(ctx, false); err != nil {
		return nil, &PhaseError{Phase: name, Op: "lease", Err: err}
	}
	pc := &phaseCtx{run: r}
	if r.tx != nil {
		u, uctx, err := r.tx.Begin(context.WithoutCancel(ctx), r.Lease)
		if err != nil {
			return nil, &PhaseError{Phase: name, Op: "begin", Err: err}
		}
		defer func() { _ = u.Rollback() }() // a no-op after Commit
		pc.unit, pc.ctx = u, uctx
	}
	fctx := context.WithValue(ctx, phaseKey{}, pc)
	if pc.ctx != nil {
		fctx = mergeValues(fctx, pc.ctx)
	}
	out, err := fn(fctx)
	if err != nil {
		return nil, &PhaseError{Phase: name, Op: "run", Err: err}
	}
	next := rec.with(CommittedPhase{Name: name, Output: out})
	if err := r.commit(ctx, pc.unit, name, next); err != nil {
		return nil, &PhaseError{Phase: name, Op: "commit", Err: err}
	}
	return out, nil
}

// commit writes rec as the recovery data at point: in unit when there is
// one, else straight to the store. Both are conditional on the lease.
func (r *Run) commit(ctx context.Context, unit Unit, point string, rec Recovery) error {
	sctx, cancel := storeCtx(ctx)
	defer cancel()
	data, now := rec.Encode(), r.now()
	var err error
	if unit != nil {
		if err = unit.SetRecoveryPoint(sctx, point, data, now); err == nil {
			err = unit.Commit()
		}
	} else {
		err = r.store.SetRecoveryPoint(sctx, r.Lease, point, data, now)
	}
	if err != nil {
		r.lost(err)
		return err
	}
	r.saved(rec, point)
	return nil
}

// External runs the phase name around a call to another service that cannot
// be rolled back (a card processor, an e-mail provider) and returns the
// call's result; an External phase that committed in an earlier execution is
// not run again: External returns the result it saved.
//
// Before calling, External records the intent (the recovery point
// "intent:<name>", committed on its own and conditional on the lease), so
// that a crash during the call is visible to the next execution. It then
// calls call with the phase's downstream key (Run.DownstreamKey(name)), which
// the call must send to the other service as its idempotency key, and
// commits the result as the phase's output. An execution that finds the
// intent recorded but no outcome (the previous owner crashed or failed
// during or right after the call) first asks lookup for the outcome under
// the same downstream key; only when lookup reports found == false does it
// call again, with the same key, so the other service can de-duplicate that
// call as well. A nil lookup means "always call again".
//
// call should return an error only when the outcome is unknown or
// retryable (a timeout, a 5xx): the intent stays recorded and a retry
// repeats the lookup-then-call. A definitive answer of the other service
// (a declined card) is a result: return it as bytes and decide in the
// handler. lookup returns found == false only when the other service
// certainly has no call under the key.
//
// The same rules as for Phase apply (order, unique names, one at a time,
// before the request's unit); while an intent is recorded no other new phase
// may start. Errors are *PhaseError: Op "intent", "lookup", "call" or
// "commit", or one of Phase's; "call" and "lookup" wrap the functions' own
// errors.
//
// While an intent is recorded without its outcome (External returned an
// error at "lookup", "call" or "commit"), the request's response is never
// stored, whatever its status: a 402 answered after a charge call that timed
// out could otherwise be replayed for a charge that went through. The
// middleware discards it, logs at Error, answers 503
// CodeRequestIncomplete, and keeps the record in progress with the intent
// and its lease ended at once, so that the client's retry (or the
// Completer) resumes at once and asks lookup for the outcome. Answer with a
// 5xx yourself to say what failed; the client sees the 503 either way.
// The request's unit is rolled back.
func (r *Run) External(ctx context.Context, name string,
	call func(ctx context.Context, downstreamKey string) ([]byte, error),
	lookup func(ctx context.Context, downstreamKey string) (result []byte, found bool, err error)) ([]byte, error) {
	rec, err := r.enter(ctx, name, true)
	if err != nil {
		return nil, err
	}
	defer r.leave()
	if out, ok := rec.committed(name); ok {
		return out, nil
	}
	if call == nil {
		return nil, &PhaseError{Phase: name, Op: "use", Err: fmt.Errorf("%w: nil call", ErrPhaseMisuse)}
	}
	key := r.DownstreamKey(name)
	resumed := rec.Pending != nil // enter checked it is this phase's
	if resumed {
		key = rec.Pending.DownstreamKey // as recorded: the key the first call used
		// Prove ownership (and renew the lease) before anything irreversible.
		if err := r.checkLease(ctx, true); err != nil {
			return nil, &PhaseError{Phase: name, Op: "lease", Err: err}
		}
		if lookup != nil {
			out, found, err := lookup(ctx, key)
			if err != nil {
				return nil, &PhaseError{Phase: name, Op: "lookup", Err: err}
			}
			if found {
				return r.settle(ctx, name, key, rec, out)
			}
		}
	} else {
		intent := Recovery{Phases: rec.Phases, Pending: &PendingCall{Phase: name, DownstreamKey: key}}
		if err := r.commit(ctx, nil, intentPoint(name), intent); err != nil {
			return nil, &PhaseError{Phase: name, Op: "intent", Err: err}
		}
		rec = intent
	}
	out, err := call(ctx, key)
	if err != nil {
		return nil, &PhaseError{Phase: name, Op: "call", Err: err}
	}
	return r.settle(ctx, name, key, rec, out)
}

// settle commits the outcome of an External phase.
func (r *Run) settle(ctx context.Context, name, key string, rec Recovery, out []byte) ([]byte, error) {
	next := rec.with(CommittedPhase{Name: name, Output: out, DownstreamKey: key})
	if err := r.commit(ctx, nil, name, next); err != nil {
		return nil, &PhaseError{Phase: name, Op: "commit", Err: err}
	}
	return out, nil
}
