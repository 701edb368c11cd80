package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime/debug"
	"time"
	"unicode/utf8"

	"github.com/saferetry/saferetry/keygen"
)

// Call is one call of a function through Do: who calls, what, with which
// key, on what payload. Its scope is (Principal, Operation, Key): another
// principal or another operation with the same key is another record.
type Call struct {
	Principal string // who; required unless anonymous keys are allowed, as for requests
	Operation string // what: names the function, as a route names a handler
	Key       string // the idempotency key: event-derived where the caller has one
	Payload   []byte // what the fingerprint covers
}

// Result is what a call of Do came to.
type Result struct {
	Output   []byte // fn's output, stored; byte for byte the same on every replay
	Replayed bool   // true when the output comes from the store and fn did not run
}

// maxOperation is the longest Call.Operation, in bytes.
const maxOperation = 255

// The statuses of a function's stored response: its output, or the message
// of a failure it marked definitive (ErrDefinitive).
const (
	statusOutput     = http.StatusOK
	statusDefinitive = http.StatusUnprocessableEntity
)

// The errors of Do.
var (
	// ErrInvalidCall: the call was refused before anything ran: an empty
	// Operation or one over 255 bytes or not valid UTF-8, a Key that
	// breaks keygen.Validate's rule (the error wraps keygen's too), no
	// Principal without WithAnonymousKeys, a Payload over
	// WithMaxRequestBody, or a nil fn. Calling again as is cannot succeed.
	ErrInvalidCall = errors.New("idempotency: invalid call")
	// ErrInProgress: a call with the same scope and payload is running
	// (its lease alive) past WithMaxInProgressWait (the error is then an
	// *InProgressError, which says when to call again), or took the record
	// over from this one (then the error wraps ErrLeaseLost too). fn did
	// not run, or its outcome was not stored. Call again later with the
	// same key.
	ErrInProgress = errors.New("idempotency: a call with this key is in progress")
	// ErrKeyReused: the key was used, in the same scope, for a call with a
	// different payload. fn did not run. Do not call again: use a new key
	// for a new call.
	ErrKeyReused = errors.New("idempotency: the key was used for a different call")
	// ErrStoreUnavailable: the store failed (the error wraps its error, and
	// ErrStoreFull when a bounded store is full); fn did not run, or
	// nothing of its unit committed. Calling again with the same key is
	// safe. A record the store can never hold is ErrRecordTooLarge alone.
	ErrStoreUnavailable = errors.New("idempotency: store unavailable")
	// ErrIncomplete: fn returned while a call to another service that it
	// made (Run.External) had an unknown outcome. Nothing was stored; the
	// record is kept at its recovery point. Call again with the same key
	// to finish it: the next execution asks lookup first. The error wraps
	// fn's own when it returned one.
	ErrIncomplete = errors.New(
		"idempotency: a call to another service has an unknown outcome; call again to finish it")
	// ErrDefinitive marks a failure of fn that is final, as a stored 4xx is
	// for a request: fn returns an error that wraps it
	// (fmt.Errorf("card declined: %w", idempotency.ErrDefinitive)). Its
	// message is stored in place of an output, and every later call with
	// the same key gets, without running fn, an error with the same
	// message for which errors.Is(err, ErrDefinitive) holds, with
	// Result.Replayed set. Any other error of fn gives the key up, so that
	// the next call runs fn again (or resumes it after a committed phase).
	ErrDefinitive = errors.New("idempotency: definitive failure")
	// ErrOutputTooLarge: the call completed, but its output (or the message
	// of its definitive failure) was over WithMaxStoredBody, so it was not
	// stored and cannot be replayed; fn does not run again (Result.Replayed
	// is set). The call that ran fn got its output.
	ErrOutputTooLarge = errors.New(
		"idempotency: the call completed, but its output was too large to store")
)

// InProgressError is the error of a call of Do whose key a running
// execution holds: errors.Is(err, ErrInProgress) holds. RetryAfter is what
// that execution's lease had left when Do returned, at least 1 ms: a call
// with the same key after it finds the outcome stored, the lease extended
// by a live owner (another InProgressError), or the record free to take
// over from an owner that stopped. A consumer redelivers the message after
// it rather than after a guess.
type InProgressError struct {
	RetryAfter time.Duration
}

// Error returns ErrInProgress's message.
func (e *InProgressError) Error() string { return ErrInProgress.Error() }

// Unwrap returns ErrInProgress.
func (e *InProgressError) Unwrap() error { return ErrInProgress }

// PanicError is the error of a call of Do whose fn panicked: the key is
// given up (or kept for a resume after a committed phase), as for a
// handler that panics.
type PanicError struct {
	Value any    // what fn panicked with
	Stack []byte // the goroutine's stack at the panic
}

// Error returns "idempotency: the function panicked: <value>".
func (e *PanicError) Error() string {
	return fmt.Sprintf("idempotency: the function panicked: %v", e.Value)
}

// Do calls fn effectively once for the scope (c.Principal, c.Operation,
// c.Key) within the replay window: the function door, for jobs, scripts
// and message consumers, with the states, options, store, phases and
// Completer of requests (see the package doc and docs/CONTRACT.md):
//
//   - a fresh key: fn runs with a Run (Phase, External, Unit,
//     DownstreamKey); its output is stored, and returned with Replayed
//     false;
//   - a completed key, same payload: the stored output, Replayed true; fn
//     does not run;
//   - a key in progress: ErrInProgress, after waiting up to
//     WithMaxInProgressWait; an expired lease is taken over (fenced), and
//     fn resumes after the last committed phase;
//   - the same key with a different payload: ErrKeyReused.
//
// An error of fn releases the key, so that the next call runs fn again,
// unless a phase committed (the next call resumes after it) or the error
// wraps ErrDefinitive (stored: every later call gets it back). Do returns
// fn's error as fn returned it. A panic of fn is caught and returned as a
// *PanicError. An output over WithMaxStoredBody completes the call
// without being stored (ErrOutputTooLarge for the later calls).
//
// fn's context is ctx, with the Run (FromContext) and canceled also when
// the lease is lost (cause ErrLeaseLost) or WithShutdown's context ends.
// The store calls Do makes for the call go on, each bounded, when ctx ends,
// so that the record is never left half written. When the store fails
// after fn succeeded and the output cannot be stored (outside a unit of
// the store's, tried for 10 s), Do returns the output all the same: fn's
// effects happened; the record stays in progress until its lease ends,
// and the failure is reported (OutcomeFailed). Output is the caller's: Do
// stores a copy. Errors are those above, ErrRecordTooLarge, and ctx's
// when it ended before the call or ends while the call waits on a key in
// progress. Do is safe for concurrent use.
func (m *Middleware) Do(ctx context.Context, c Call,
	fn func(ctx context.Context, run *Run) ([]byte, error)) (Result, error) {
	if err := m.checkCall(c, fn); err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err // nothing claimed for a caller that has gone
	}
	req := newRequest(ctx, Scope{Principal: c.Principal, Route: c.Operation, Key: c.Key},
		fingerprintInput{route: c.Operation, body: c.Payload}, storedRequest{Body: c.Payload})
	cl := m.claim(req)
	switch {
	case cl.gone:
		return Result{}, fmt.Errorf("%w: stopped waiting: %w", ErrInProgress, cl.err)
	case cl.err != nil:
		return Result{}, m.storeFailed(ctx, req.scope, cl.err)
	case cl.verdict == verdictRun:
		res, _, err := m.perform(req, cl.res, false, fn)
		return res, err
	}
	return m.answerCall(ctx, req.scope, cl.verdict, cl.res.Record)
}

// checkCall returns the ErrInvalidCall of a call Do refuses, or nil.
func (m *Middleware) checkCall(c Call, fn func(ctx context.Context, run *Run) ([]byte,
	error)) error {
	invalid := func(why string) error { return fmt.Errorf("%w: %s", ErrInvalidCall, why) }
	switch {
	case fn == nil:
		return invalid("nil function")
	case c.Operation == "" || len(c.Operation) > maxOperation || !utf8.ValidString(c.Operation):
		return invalid(fmt.Sprintf(
			"an operation is 1 to %d bytes of valid UTF-8; got %d bytes", maxOperation,
			len(c.Operation)))
	case c.Principal == "" && !m.cfg.anonymous:
		return invalid("a call with a key must name its principal (or the Middleware allow " +
			"anonymous keys: WithAnonymousKeys)")
	case int64(len(c.Payload)) > m.cfg.maxRequestBody:
		return invalid(fmt.Sprintf("the payload is %d bytes, over WithMaxRequestBody (%d)",
			len(c.Payload), m.cfg.maxRequestBody))
	}
	if err := keygen.Validate(c.Key); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidCall, err)
	}
	return nil
}

// storeFailed returns the error of a call whose claim or read the store
// failed, and reports it as the HTTP door would refuse it.
func (m *Middleware) storeFailed(ctx context.Context, s Scope, err error) error {
	code := CodeStoreUnavailable
	switch {
	case errors.Is(err, ErrRecordTooLarge):
		m.obs.refused(ctx, Event{Scope: s, Code: CodeRequestTooLarge, Err: err})
		return fmt.Errorf("idempotency: %w", err)
	case errors.Is(err, ErrStoreFull):
		code = CodeStoreFull
	}
	m.obs.refused(ctx, Event{Scope: s, Code: code, Err: err})
	return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
}

// answerCall answers a call from a record it does not own, as v says:
// replay, reused key, or in progress.
func (m *Middleware) answerCall(ctx context.Context, s Scope, v verdict,
	rec Record) (Result, error) {
	switch v {
	case verdictReused:
		m.obs.refused(ctx, Event{Scope: s, Code: CodeKeyReused})
		return Result{}, ErrKeyReused
	case verdictReplay:
		return m.replayCall(ctx, s, rec)
	}
	m.obs.refused(ctx, Event{Scope: s, Code: CodeInProgress})
	// The lease is alive up to and including LeaseUntil: a claim takes it
	// over strictly after.
	return Result{}, &InProgressError{
		RetryAfter: max(time.Until(rec.LeaseUntil)+time.Millisecond, time.Millisecond)}
}

// replayCall answers a call with rec's stored outcome.
func (m *Middleware) replayCall(ctx context.Context, s Scope, rec Record) (Result, error) {
	resp := rec.Response
	switch {
	case resp == nil:
		return Result{}, m.storeFailed(ctx, s,
			errors.New("idempotency: a completed record without a response"))
	case resp.Header.Get(notReplayableHeader) != "":
		m.obs.refused(ctx, Event{Scope: s, Code: CodeResponseNotReplayable})
		return Result{Replayed: true}, ErrOutputTooLarge
	}
	m.obs.replayed(ctx, Event{Scope: s})
	if resp.Status == statusDefinitive {
		return Result{Replayed: true}, definitiveFailure(resp.Body)
	}
	// The store's bytes are shared by every replay: the caller gets a copy.
	return Result{Output: bytes.Clone(resp.Body), Replayed: true}, nil
}

// definitiveFailure is the error of a replayed definitive failure: the
// message fn's error had.
type definitiveFailure string

func (f definitiveFailure) Error() string { return string(f) }

// Is reports whether target is ErrDefinitive.
func (f definitiveFailure) Is(target error) bool { return target == ErrDefinitive }

// perform runs fn as the owner of res.Record (background: the Completer's
// resume, which stops with req.ctx as Do's call does) and returns what Do
// returns, and the outcome (see Observer.Executed).
func (m *Middleware) perform(req request, res ClaimResult, background bool,
	fn func(ctx context.Context, run *Run) ([]byte, error)) (r Result, o Outcome, err error) {
	defer func() {
		if p := recover(); p != nil {
			// The core settled the record on the way: the key is given up
			// or kept for a resume.
			r, o, err = Result{}, OutcomePanicked, &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	var out []byte
	var fnErr error
	e, s := m.execute(req, res, background, false, func(ctx context.Context, run *Run) ending {
		out, fnErr = fn(ctx, run)
		return m.callEnding(out, fnErr)
	})
	o = s.outcome(e)
	switch {
	case s.lost():
		if s.recErr == nil && s.rec.State == Completed {
			if !sameRequest(req, s.rec) {
				return Result{}, o, ErrKeyReused
			}
			r, err = m.replayCall(req.bg, req.scope, s.rec) // a successor's answer
			return r, o, err
		}
		return Result{}, o, fmt.Errorf("%w: another execution took the key over: %w",
			ErrInProgress, ErrLeaseLost)
	case s.undone:
		return Result{}, o, fmt.Errorf("%w: %w", ErrStoreUnavailable, s.err)
	case s.err == nil && s.incomplete && fnErr != nil:
		return Result{}, o, fmt.Errorf("%w: %w", ErrIncomplete, fnErr)
	case s.err == nil && s.incomplete:
		return Result{}, o, ErrIncomplete
	case fnErr != nil:
		return Result{}, o, fnErr
	}
	return Result{Output: out}, o, nil
}

// callEnding is what fn's return comes to: its output, or the message of
// a definitive failure, to store; nothing for any other error.
func (m *Middleware) callEnding(out []byte, err error) ending {
	resp := Response{Status: statusOutput}
	switch {
	case errors.Is(err, ErrDefinitive):
		resp.Status, out = statusDefinitive, []byte(err.Error())
	case err != nil:
		return ending{}
	}
	if int64(len(out)) > m.cfg.maxStoredBody {
		resp.Header = http.Header{notReplayableHeader: {"body-too-large"}}
	} else {
		resp.Body = bytes.Clone(out) // the store may keep it; fn's slice stays fn's
	}
	return ending{resp: &resp}
}
