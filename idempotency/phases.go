package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// recoveryVersion is the version of the recovery data format that Phase
// and External write in Record.RecoveryData.
const recoveryVersion = 1

// maxPhaseName is the longest phase name, in bytes.
const maxPhaseName = 128

// validPhaseName reports whether name can be a phase's (and an External
// call's) name: 1 to maxPhaseName bytes of valid UTF-8, not starting with
// intentPrefix. The recovery data is JSON, in which every such string
// round-trips byte for byte and any other would not (invalid UTF-8 becomes
// U+FFFD), so that a committed phase would be run again, or a pending call
// never found; and a committed phase's recovery point that read as an
// intent would make every answer of the request CodeRequestIncomplete.
func validPhaseName(name string) bool {
	return name != "" && len(name) <= maxPhaseName && utf8.ValidString(name) &&
		!strings.HasPrefix(name, intentPrefix)
}

// recovery is the decoded Record.RecoveryData that Phase and External keep:
// the committed phases in order and, at most one at a time, an External
// call whose intent is recorded but whose outcome is not. It is versioned
// JSON; outputs are base64 in it.
type recovery struct {
	Phases  []committedPhase `json:"phases,omitempty"`
	Pending *pendingCall     `json:"pending,omitempty"`
}

// committedPhase is a phase whose work committed: its output is returned
// again, without running it, to every later execution.
type committedPhase struct {
	Name          string `json:"name"`
	Output        []byte `json:"output,omitempty"`
	DownstreamKey string `json:"downstream_key,omitempty"` // set for an External phase
}

// pendingCall is the intent of an External phase: recorded before the call,
// cleared when its outcome commits.
type pendingCall struct {
	Phase         string `json:"phase"`
	DownstreamKey string `json:"downstream_key"`
}

type recoveryWire struct {
	Version int `json:"v"`
	recovery
}

var errBadRecoveryData = errors.New("idempotency: malformed recovery data")

func (rec recovery) encode() []byte {
	// Strings and bytes only: it cannot fail.
	b, _ := json.Marshal(recoveryWire{Version: recoveryVersion, recovery: rec})
	return b
}

// decodeRecovery decodes what encode wrote; empty data is an empty
// recovery. Errors wrap errBadRecoveryData: invalid JSON, another version,
// an empty or repeated phase name, or a pending call for a committed phase.
func decodeRecovery(data []byte) (recovery, error) {
	if len(data) == 0 {
		return recovery{}, nil
	}
	var w recoveryWire
	if err := json.Unmarshal(data, &w); err != nil {
		return recovery{}, errors.Join(errBadRecoveryData, err)
	}
	if w.Version != recoveryVersion {
		return recovery{}, fmt.Errorf("%w: version %d, want %d", errBadRecoveryData, w.Version,
			recoveryVersion)
	}
	seen := make(map[string]bool, len(w.Phases))
	for _, p := range w.Phases {
		if p.Name == "" || seen[p.Name] {
			return recovery{}, fmt.Errorf("%w: empty or repeated phase name %q", errBadRecoveryData,
				p.Name)
		}
		seen[p.Name] = true
	}
	if w.Pending != nil && (w.Pending.Phase == "" || seen[w.Pending.Phase]) {
		return recovery{}, fmt.Errorf("%w: pending call for phase %q", errBadRecoveryData,
			w.Pending.Phase)
	}
	return w.recovery, nil
}

// committed returns the saved output of a committed phase.
func (rec recovery) committed(name string) ([]byte, bool) {
	for _, p := range rec.Phases {
		if p.Name == name {
			return p.Output, true
		}
	}
	return nil, false
}

// last returns the name of the last committed phase: the recovery point
// of rec without its pending call ("" before any).
func (rec recovery) last() string {
	if len(rec.Phases) == 0 {
		return ""
	}
	return rec.Phases[len(rec.Phases)-1].Name
}

// with returns a copy of rec with phase p committed and no pending call.
func (rec recovery) with(p committedPhase) recovery {
	phases := make([]committedPhase, 0, len(rec.Phases)+1)
	phases = append(phases, rec.Phases...)
	return recovery{Phases: append(phases, p)}
}

// intentPrefix starts the recovery point of a recorded intent.
const intentPrefix = "intent:"

// ErrNotExecuted is what the call of an External phase returns, wrapped,
// when the other service answered definitively that it did nothing: a
// 4xx that charged nothing, a 503 that it answered before any work. The
// phase's intent is then withdrawn: the next execution calls again without
// a lookup, the answer is not held back as incomplete, and nothing is
// logged as an unknown outcome. The error returned by External is a
// *PhaseError (Step "call") that wraps it.
var ErrNotExecuted = errors.New("idempotency: the call was not executed")

// PhaseError reports a phase that did not commit. Step is where it stopped:
// "use" (misuse: wraps ErrMisuse), "decode" (the record's recovery data is
// not Phase's), "lease" (the lease was lost or ran out before the phase:
// wraps ErrLeaseLost), "begin" (the store's Begin), "run" (fn returned
// Err), "intent" (recording an External call's intent), "lookup" and
// "call" (an External phase's functions returned Err; the intent stays
// recorded) or "commit". A lost lease at "intent" or "commit" wraps
// ErrLeaseLost: nothing of the phase committed.
type PhaseError struct {
	Phase string
	Step  string
	Err   error
}

// Error returns "idempotency: phase <name>: <step>: <cause>".
func (e *PhaseError) Error() string {
	return fmt.Sprintf("idempotency: phase %q: %s: %v", e.Phase, e.Step, e.Err)
}

// Unwrap returns the cause.
func (e *PhaseError) Unwrap() error { return e.Err }

type phaseKey struct{}

// phaseCtx marks the context of a running phase.
type phaseCtx struct {
	run  *Run
	unit *openUnit // nil when the store is not a Transactor (Unit finds none)
}

// enter starts phase name: it checks the rules of ErrMisuse, decodes
// the recovery data once and returns the current recovery. On success the
// caller must call leave.
func (r *Run) enter(ctx context.Context, name string, external bool) (recovery, error) {
	misuse := func(format string, a ...any) (recovery, error) {
		err := fmt.Errorf("%w: "+format, append([]any{ErrMisuse}, a...)...)
		return recovery{}, &PhaseError{Phase: name, Step: "use", Err: err}
	}
	if p, ok := ctx.Value(phaseKey{}).(*phaseCtx); ok && p.run == r {
		return misuse("called inside another phase")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.done:
		return recovery{}, &PhaseError{Phase: name, Step: "use", Err: errRunDone}
	case r.expired:
		return recovery{}, &PhaseError{Phase: name, Step: "lease", Err: errLeaseExpired}
	case !validPhaseName(name):
		return misuse("a phase name is 1 to %d bytes of valid UTF-8, not starting with %q; "+
			"got %.*q", maxPhaseName, intentPrefix, maxPhaseName, name)
	case r.oneTx:
		return recovery{}, &PhaseError{Phase: name, Step: "use", Err: ErrOneTransaction}
	case r.inPhase:
		return misuse("another phase is running")
	case r.unit != nil || r.unitErr != nil || r.beginning:
		return misuse("the request's unit of work is open; run phases before using it")
	case r.seen[name]:
		return misuse("phase name used twice in one execution")
	}
	if r.rec == nil {
		rec, err := decodeRecovery(r.recoveryData)
		if err != nil {
			return recovery{}, &PhaseError{Phase: name, Step: "decode", Err: err}
		}
		r.rec = &rec
	}
	rec := *r.rec
	_, done := rec.committed(name)
	if p := rec.Pending; !done && p != nil && (p.Phase != name || !external) {
		return misuse("the outcome of external phase %q is unknown; call External(%q) first",
			p.Phase, p.Phase)
	}
	if r.seen == nil {
		r.seen = make(map[string]bool)
	}
	r.seen[name] = true
	r.inPhase, r.phase = true, name
	return rec, nil
}

// leave ends the running phase, and its unit if nothing ended it (fn
// failed or panicked).
func (r *Run) leave(u *openUnit) {
	r.mu.Lock()
	r.inPhase, r.phase = false, ""
	r.mu.Unlock()
	if u != nil {
		r.m.g.end(r.bg, u)
	}
}

// advance records a commit of the recovery data: the run is at point now.
func (r *Run) advance(rec recovery, point string) {
	r.mu.Lock()
	r.rec, r.point = &rec, point
	r.mu.Unlock()
}

// lost cancels the work when a write found the lease lost.
func (r *Run) lost(err error) {
	if errors.Is(err, ErrLeaseLost) {
		r.cancelWork(ErrLeaseLost)
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
	now := time.Now()
	if !force && now.Before(until) {
		return nil
	}
	next := now.Add(r.m.cfg.lease)
	if err := r.m.g.heartbeat(r.bg, r.Lease, next); err != nil {
		r.lost(err)
		return err
	}
	r.extend(next)
	return nil
}

// Phase runs fn as the atomic phase name and returns its output; a phase
// that committed in an earlier execution of this request is not run again,
// and Phase returns the output it saved.
//
// With a Transactor store fn runs in a unit of its own (sqlstore.Tx(ctx)
// returns its transaction), whose writes commit together with the
// record's recovery point (name) and fn's output, or not at all: when fn
// fails or panics, or the lease was lost (ErrLeaseLost; the handler's
// context is then canceled). With a plain Store only the recovery point is
// recorded after fn returns.
//
// fn must be deterministic in what it commits and must not call services
// that cannot be rolled back (External is for those). Phases come in the
// same order in every execution, with names of 1 to 128 bytes of valid
// UTF-8 unique within it that do not start with "intent:" (any other name
// is refused, ErrMisuse, before anything runs), one at a time and before
// the request's unit is begun; names and outputs round-trip byte for byte
// through the record, so keep outputs small.
//
// Errors are *PhaseError; Step "run" wraps fn's own error. After an error
// answer with a status that is not stored (5xx): the record stays in
// progress at its recovery point, its lease ended at once, so that a retry
// or the Completer resumes.
func (r *Run) Phase(ctx context.Context, name string,
	fn func(ctx context.Context) ([]byte, error)) ([]byte, error) {
	rec, err := r.enter(ctx, name, false)
	if err != nil {
		return nil, err
	}
	if out, ok := rec.committed(name); ok {
		r.leave(nil)
		return out, nil
	}
	if fn == nil {
		r.leave(nil)
		return nil, &PhaseError{Phase: name, Step: "use",
			Err: fmt.Errorf("%w: nil function", ErrMisuse)}
	}
	if err := r.checkLease(ctx, false); err != nil {
		r.leave(nil)
		return nil, &PhaseError{Phase: name, Step: "lease", Err: err}
	}
	unit, err := r.m.g.open(r.bg, r.Lease)
	if err != nil {
		r.leave(nil)
		return nil, &PhaseError{Phase: name, Step: "begin", Err: err}
	}
	defer r.leave(unit) // ends the unit unless its commit did
	pc := &phaseCtx{run: r}
	fctx := context.WithValue(ctx, phaseKey{}, pc)
	if unit.inTx {
		pc.unit = unit
		fctx = mergeValues(fctx, unit.ctx)
	}
	out, err := fn(fctx)
	if err != nil {
		return nil, &PhaseError{Phase: name, Step: "run", Err: err}
	}
	next := rec.with(committedPhase{Name: name, Output: out})
	if err := r.saveIn(unit, name, next); err != nil {
		return nil, &PhaseError{Phase: name, Step: "commit", Err: err}
	}
	return out, nil
}

// saveIn writes rec as the recovery data at point in unit, conditional on
// the lease, and ends unit. A write whose outcome is unknown is settled by
// the record: this lease's, at this point with this data, the write is
// this one.
func (r *Run) saveIn(unit *openUnit, point string, rec recovery) error {
	data, now := rec.encode(), time.Now()
	save := func(ctx context.Context) error { return unit.SetRecoveryPoint(ctx, point, data, now) }
	err := r.m.g.write(r.bg, kindSetPoint, kindSetPointInUnit, unit, save,
		func(got Record, err error) bool {
			return err == nil && got.State == InProgress && ownedBy(got, r.Lease) &&
				got.RecoveryPoint == point && bytes.Equal(got.RecoveryData, data)
		})
	if err != nil {
		r.lost(err)
		return err
	}
	r.advance(rec, point)
	return nil
}

// External runs the phase name around call, a call to another service that
// cannot be rolled back (a card processor, a mail provider), and returns
// its result; one that committed in an earlier execution is not run again.
//
// Before the call it records the intent ("intent:<name>", on its own,
// fenced), so that a crash during the call is visible to the next
// execution; it passes call the phase's downstream key (DownstreamKey),
// which call must send as the other service's idempotency key, and commits
// the result as the phase's output. An execution that finds the intent
// without an outcome first asks lookup for the outcome under the same key,
// and calls again, with that key, only when lookup reports found == false
// (a nil lookup always calls again).
//
// call returns a result for a definitive answer that the phase keeps (a
// declined card, to store and show), and an error otherwise. An error
// wrapping ErrNotExecuted says that the other service definitively did
// nothing (a 4xx that charged nothing, a 503 answered before any work):
// the intent is withdrawn, so that the next execution calls again without
// asking lookup, and the execution's answer is handled as any answer. Any
// other error leaves the outcome unknown: while an intent has no outcome,
// no other new phase may start, and the answer of the request (or the
// call of Do) is never stored: the HTTP door answers 503
// CodeRequestIncomplete, Do returns ErrIncomplete, and the record is kept
// for a resume. name follows Phase's rules. Errors are *PhaseError (Step
// "intent", "lookup", "call", "commit", or one of Phase's).
//
// A warning for call: Go's net/http sends a request again by itself, once
// and silently, when the kept-alive connection it rode dies before the
// answer, if the request may be replayed, and a POST that carries an
// Idempotency-Key header (with a GetBody, as http.NewRequest sets) may.
// Against a provider that ignores the key, that re-send is a second charge
// that call never sees and no log shows. Send call's requests through a
// saferetry Transport, which refuses that re-send for a request with a body
// (its own loop decides the retry) and counts a bodyless request's re-send
// as an attempt; a plain http.Client does neither. Against such a provider,
// also give lookup a way to find the first call's effect.
func (r *Run) External(ctx context.Context, name string,
	call func(ctx context.Context, downstreamKey string) ([]byte, error),
	lookup func(ctx context.Context, downstreamKey string) (result []byte, found bool, err error),
) ([]byte, error) {
	rec, err := r.enter(ctx, name, true)
	if err != nil {
		return nil, err
	}
	defer r.leave(nil)
	if out, ok := rec.committed(name); ok {
		return out, nil
	}
	if call == nil {
		return nil, &PhaseError{Phase: name, Step: "use",
			Err: fmt.Errorf("%w: nil call", ErrMisuse)}
	}
	key := r.DownstreamKey(name)
	resumed := rec.Pending != nil // enter checked it is this phase's
	if resumed {
		key = rec.Pending.DownstreamKey // as recorded: the key the first call used
		// Prove ownership (and renew the lease) before anything irreversible.
		if err := r.checkLease(ctx, true); err != nil {
			return nil, &PhaseError{Phase: name, Step: "lease", Err: err}
		}
		if lookup != nil {
			out, found, err := lookup(ctx, key)
			if err != nil {
				return nil, &PhaseError{Phase: name, Step: "lookup", Err: err}
			}
			if found {
				return r.saveOutcome(name, key, rec, out)
			}
		}
	} else {
		pending := &pendingCall{Phase: name, DownstreamKey: key}
		intent := recovery{Phases: rec.Phases, Pending: pending}
		if err := r.save(intentPrefix+name, intent); err != nil {
			return nil, &PhaseError{Phase: name, Step: "intent", Err: err}
		}
		rec = intent
	}
	out, err := call(ctx, key)
	switch {
	case errors.Is(err, ErrNotExecuted):
		// Definitively nothing happened: the intent is withdrawn, so that
		// the next execution calls again without a lookup, and the answer
		// may be stored.
		if err := r.save(rec.last(), recovery{Phases: rec.Phases}); err != nil {
			return nil, &PhaseError{Phase: name, Step: "intent", Err: err}
		}
		return nil, &PhaseError{Phase: name, Step: "call", Err: err}
	case err != nil:
		return nil, &PhaseError{Phase: name, Step: "call", Err: err}
	}
	return r.saveOutcome(name, key, rec, out)
}

// saveOutcome commits the outcome of an External phase.
func (r *Run) saveOutcome(name, key string, rec recovery, out []byte) ([]byte, error) {
	next := rec.with(committedPhase{Name: name, Output: out, DownstreamKey: key})
	if err := r.save(name, next); err != nil {
		return nil, &PhaseError{Phase: name, Step: "commit", Err: err}
	}
	return out, nil
}

// save writes rec as the recovery data at point, on its own (an
// auto-commit unit: an External phase holds no transaction).
func (r *Run) save(point string, rec recovery) error {
	return r.saveIn(r.m.g.autoCommit(r.Lease), point, rec)
}
