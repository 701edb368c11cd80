package saferetry

import (
	"context"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/retry"
)

// Outcomes of an attempt, in AttemptDoneInfo.Outcome and CallDoneInfo.Outcome,
// besides the retry.Reason* constants, which say why the loop stopped while
// the outcome was still a retryable failure (or why it could not go on).
const (
	// OutcomeFinal: the loop returns this attempt's response, a success or
	// a status that is not retried. (An error that is not retried ends the
	// loop with retry.ReasonNotRetryable, or retry.ReasonCanceled for the
	// caller's cancellation or deadline.)
	OutcomeFinal = "final"
	// OutcomeRetry: the attempt failed and will be retried after Wait.
	OutcomeRetry = "retry"
)

// Observer sees every attempt and every call of a Transport. Each field is
// optional; a nil one costs nothing. Install one with WithObserver; several
// compose, and each sees every event, in the order they were given (the
// logging observer of WithLogger first).
//
// The functions run synchronously on the goroutine of RoundTrip, on the
// request's path: they must be fast and must not block. They may be called
// concurrently for different requests. They must not read or close a
// response body, nor modify the request, the response or the headers they
// are given. The Key they are given is the raw key: never log or export it,
// use keygen.Digest. A panic in them is not recovered.
type Observer struct {
	// AttemptStart is called before each attempt is prepared (WithPrepare)
	// and sent. The context it returns, which must be ctx or derived from
	// it, becomes the parent of the attempt's context: the one the
	// preparation and the base transport see (r.Context()), and the one
	// AttemptDone receives. Return ctx to add nothing; a nil return counts
	// as ctx. It should only add values (a tracing span): a returned context
	// that ends (a deadline, a cancellation) ends the attempt with it, and
	// that error is not retried.
	AttemptStart func(ctx context.Context, info AttemptStartInfo) context.Context

	// AttemptDone is called once per attempt whose AttemptStart was called,
	// when its outcome and what the loop does next are known: before the
	// sleep of a retry, before RoundTrip returns after the last one. ctx is
	// the context AttemptStart returned.
	AttemptDone func(ctx context.Context, info AttemptDoneInfo)

	// CallDone is called once per RoundTrip that made at least one attempt,
	// just before RoundTrip returns. ctx is the request's context. It is
	// not called when RoundTrip fails before any attempt (an invalid key, an
	// unreadable body).
	CallDone func(ctx context.Context, info CallDoneInfo)
}

// AttemptStartInfo describes an attempt about to be sent.
type AttemptStartInfo struct {
	Request *http.Request // the caller's request (read-only)
	Attempt int           // 1 for the first attempt
	Key     string        // the idempotency key every attempt carries, "" for none
	// RetryReason is the Decision.Class of the previous attempt's outcome,
	// which this attempt retries ("status_503", "conn_refused"); "" for
	// the first attempt.
	RetryReason string
	// NotRetrying is why this request will not be retried whatever its
	// outcome (retry.ReasonBodyNotRewindable for a body too large to
	// buffer), "" when it may be.
	NotRetrying string
}

// AttemptDoneInfo describes the outcome of one attempt and what the loop
// does next.
type AttemptDoneInfo struct {
	Request *http.Request // the caller's request (read-only)
	Attempt int           // 1 for the first attempt
	Key     string        // "" for none
	// Decision is the classification of the outcome (its Class is the
	// label for logs and metrics: "status_503", "conn_refused", ...).
	Decision retry.Decision
	// Response is the attempt's response (status and headers only: never
	// read its body), nil when there is none.
	Response *http.Response
	// Err is the attempt's error, nil when Response is set. When the
	// preparation failed (Outcome retry.ReasonPrepare) it is the
	// *PrepareError and the attempt was not sent.
	Err error
	// Elapsed is the attempt's duration, until its response headers or its
	// error; Total the time since the call's first attempt started.
	Elapsed, Total time.Duration
	// Outcome is OutcomeFinal, OutcomeRetry, or the retry.Reason* constant
	// that ended the loop.
	Outcome string
	// Wait is the sleep chosen before the next attempt (Outcome
	// OutcomeRetry only).
	Wait time.Duration
	// BudgetDenied is true when the retry budget refused this retry
	// (Outcome retry.ReasonBudget); BudgetLeft is then the tokens left.
	// A granted retry has Outcome OutcomeRetry.
	BudgetDenied bool
	BudgetLeft   int
}

// CallDoneInfo describes a finished call: one RoundTrip and its attempts.
type CallDoneInfo struct {
	Request  *http.Request // the caller's request (read-only)
	Key      string        // "" for none
	Attempts int           // attempts made (the one whose preparation failed not counted)
	// Outcome is the last attempt's Outcome: OutcomeFinal, or the
	// retry.Reason* constant that ended the loop (retry.ReasonCanceled
	// also when the caller canceled during a sleep).
	Outcome string
	// Response is the response RoundTrip returns (never read its body),
	// Err the error; exactly one is non-nil.
	Response *http.Response
	Err      error
	Total    time.Duration // from the first attempt's start to the return
}

// observers is the Transport's observers, with what they use, so that an
// unset hook costs a branch.
type observers struct {
	list         []Observer
	attemptStart bool
	attemptDone  bool
	callDone     bool
}

func newObservers(list []Observer) observers {
	o := observers{list: list}
	for _, x := range list {
		o.attemptStart = o.attemptStart || x.AttemptStart != nil
		o.attemptDone = o.attemptDone || x.AttemptDone != nil
		o.callDone = o.callDone || x.CallDone != nil
	}
	return o
}

func (o *observers) startAttempt(ctx context.Context, info AttemptStartInfo) context.Context {
	for _, x := range o.list {
		if x.AttemptStart != nil {
			if d := x.AttemptStart(ctx, info); d != nil {
				ctx = d
			}
		}
	}
	return ctx
}

func (o *observers) doneAttempt(ctx context.Context, info AttemptDoneInfo) {
	for _, x := range o.list {
		if x.AttemptDone != nil {
			x.AttemptDone(ctx, info)
		}
	}
}

func (o *observers) doneCall(ctx context.Context, info CallDoneInfo) {
	for _, x := range o.list {
		if x.CallDone != nil {
			x.CallDone(ctx, info)
		}
	}
}
