package saferetry

import (
	"context"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/retry"
)

// Outcome is what the retry loop did after an attempt: a label for logs
// and metrics (snake_case), in AttemptDoneInfo and CallDoneInfo.
type Outcome string

// The outcomes of an attempt, and of a call (final or stopped).
const (
	// OutcomeRetry: the outcome may be retried, and will be after Wait.
	OutcomeRetry Outcome = "retry"
	// OutcomeFinal: the outcome is not retried (Decision.Retry is false):
	// a success, a status or an error outside the allow-list, the caller's
	// own cancellation or deadline. It is returned as it is.
	OutcomeFinal Outcome = "final"
	// OutcomeStopped: the outcome could have been retried but the loop
	// stopped, for the reason in Stop (the attempt limit, the deadline, a
	// Retry-After longer than WithMaxRetryAfter, the budget, the caller's
	// cancellation, a body that cannot be sent again, an answer marked as
	// retried below, or a preparation that failed before the attempt was
	// sent).
	OutcomeStopped Outcome = "stopped"
	// OutcomeLost: another attempt of the call, in flight at the same time
	// (WithHedging), gave the final answer first; this one was canceled,
	// and its outcome is never read (Response and Err are nil).
	OutcomeLost Outcome = "lost"
	// OutcomeDiscarded: the outcome came while another attempt of the call
	// was in flight (WithHedging): a retryable answer or an error, set
	// aside while the loop waits for the others, then closed; or a hedge
	// whose preparation failed (Err is its error), never sent.
	OutcomeDiscarded Outcome = "discarded"
)

// Observer sees every attempt and every call of a Transport. Each field is
// optional; a nil one costs nothing. Install one with WithObserver; several
// compose, and each sees every event, in the order they were given (the
// logging observer of WithLogger first).
//
// The functions run synchronously on the request's path, on the goroutine
// of RoundTrip or, for a re-send of the base transport's (see the package
// documentation), on the goroutine that sends it: a hedge's runs beside
// RoundTrip's. They must be fast and must not block. They may be called
// concurrently for different requests, never for one. They must not read
// or close a response body, nor modify the request, the response or the
// headers they are given. The Key they are given is the raw key: never log
// or export it, use keygen.Digest. A panic in them is not recovered.
type Observer struct {
	// AttemptStart is called before each attempt is prepared (WithPrepare)
	// and sent. The context it returns, which must be ctx or derived from
	// it, becomes the parent of the attempt's context: the one the
	// preparation and the base transport see (r.Context()), and the one
	// AttemptDone receives. Return ctx to add nothing; a nil return counts
	// as ctx. It should only add values (a tracing span): a returned context
	// that ends (a deadline, a cancellation) ends the attempt with it, and
	// that error is not retried. For a re-send of the base transport's, it
	// is called once the re-send has a connection, before it is written,
	// and the context it returns goes only to AttemptDone: the request is
	// on its way with the attempt's context.
	AttemptStart func(ctx context.Context, info AttemptStartInfo) context.Context

	// AttemptDone is called once per attempt whose AttemptStart was called,
	// when its outcome and what the loop does next are known: before the
	// sleep of a retry, before RoundTrip returns after the last one; for a
	// hedged request, also when an attempt is discarded, and when one that
	// lost has ended (OutcomeLost); for an attempt the base transport sends
	// again by itself, when the re-send starts (OutcomeRetry, class
	// retry.ClassResend, no wait). ctx is the context AttemptStart
	// returned.
	AttemptDone func(ctx context.Context, info AttemptDoneInfo)

	// CallDone is called once per RoundTrip that made at least one attempt,
	// just before RoundTrip returns. ctx is the request's context. It is
	// not called when RoundTrip fails before any attempt (an invalid key, an
	// unreadable body).
	CallDone func(ctx context.Context, info CallDoneInfo)

	// Poll is called once per poll of a 202's monitor (WithFollowAccepted),
	// when its outcome and what follows are known, before CallDone. ctx is
	// the request's context.
	Poll func(ctx context.Context, info PollInfo)
}

// AttemptStartInfo describes an attempt about to be sent.
type AttemptStartInfo struct {
	Request *http.Request // the caller's request (read-only)
	Attempt int           // 1 for the first attempt
	Key     string        // the idempotency key every attempt carries, "" for none
	// Retrying is the class of the previous attempt's outcome, which this
	// attempt retries ("status_503", "conn_refused"); "" for the first.
	Retrying retry.Class
	// NotRetrying is why this request will not be retried whatever its
	// outcome (retry.ReasonBodyNotRewindable for a body too large to
	// buffer), "" when it may be.
	NotRetrying retry.Reason
	// Hedge is true for a hedge (WithHedging): an attempt sent beside
	// attempts still in flight, not after one (its Retrying is "").
	Hedge bool
}

// AttemptDoneInfo describes the outcome of one attempt and what the loop
// does next.
type AttemptDoneInfo struct {
	Request *http.Request // the caller's request (read-only)
	Attempt int           // 1 for the first attempt
	Key     string        // "" for none
	Hedge   bool          // a hedge (see AttemptStartInfo.Hedge)
	// Decision is the classification of the outcome; its Class is the
	// label for logs and metrics.
	Decision retry.Decision
	// Response is the attempt's response (status and headers only: never
	// read its body), nil when there is none.
	Response *http.Response
	// Err is the attempt's error, nil when Response is set. When the
	// preparation failed (Stop retry.ReasonPrepare), the attempt was not
	// sent and Err is the preparation's error. Its text never holds the
	// key: wherever the key shows up in it (a server that echoed it into a
	// status line), it reads "[key <keygen.Digest>]"; the error it wraps
	// is the base transport's, unchanged, for errors.Is and errors.As.
	Err error
	// Elapsed is the attempt's duration, until its outcome was classified;
	// Total the time since the call's first attempt started.
	Elapsed, Total time.Duration
	// Outcome is what the loop does next.
	Outcome Outcome
	// Stop is why the loop ends with this attempt, "" when it retries it
	// (and for OutcomeLost and OutcomeDiscarded): retry.ReasonNotRetryable
	// or retry.ReasonCanceled for OutcomeFinal, any Reason for
	// OutcomeStopped.
	Stop retry.Reason
	// Wait is the sleep before the next attempt (OutcomeRetry only).
	Wait time.Duration
	// BudgetLeft is what the retry budget had left when it refused this
	// retry (Stop retry.ReasonBudget only): tokens, or retries for a ratio.
	BudgetLeft int
}

// CallDoneInfo describes a finished call: one RoundTrip and its attempts.
type CallDoneInfo struct {
	Request  *http.Request // the caller's request (read-only)
	Key      string        // "" for none
	Attempts int           // attempts made (not one whose preparation failed)
	// Outcome is OutcomeFinal or OutcomeStopped, as for the last attempt
	// (OutcomeStopped also when the caller canceled during a wait).
	Outcome Outcome
	// Stop is why the loop ended (see AttemptDoneInfo.Stop).
	Stop retry.Reason
	// Response is the response RoundTrip returns (never read its body),
	// Err the error; exactly one is non-nil. Err's text never holds the
	// key (see AttemptDoneInfo.Err).
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
	poll         bool
}

func newObservers(list []Observer) observers {
	o := observers{list: list}
	for _, x := range list {
		o.attemptStart = o.attemptStart || x.AttemptStart != nil
		o.attemptDone = o.attemptDone || x.AttemptDone != nil
		o.callDone = o.callDone || x.CallDone != nil
		o.poll = o.poll || x.Poll != nil
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

func (o *observers) donePoll(ctx context.Context, info PollInfo) {
	for _, x := range o.list {
		if x.Poll != nil {
			x.Poll(ctx, info)
		}
	}
}
