// Package decide is the retry loop's one decision, shared by the saferetry
// Transport and the fleetsim simulation (examples/fleetsim) so that the two
// can never drift apart: after an attempt, from its classified outcome, the
// attempt count, the overall deadline and Retry-After, whether to retry and
// how long to wait first, or why to stop (Decide, which changes nothing);
// the step that commits a retry Decide granted, taking its cost from the
// retry budget (Grant), and the one that gives that cost back when the
// retry is then never sent (Refund); what the retry budget hears of a call
// besides its retries (Begin, End); and, once the loop has stopped, whether
// the call pushes back on the request it was made for, across a chain of
// services (PushBack). Hedge decides whether attempts in flight get a hedge
// beside them, as purely as Decide decides a retry.
//
// The loop runs the two steps in order: Decide, then, for a retry, the
// actions that may still stop it (the Transport rewinds the request body
// first), then Grant, last, so that a retry stopped for any other reason
// costs nothing.
package decide

import (
	"math/rand/v2"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// The Transport's defaults, in one place for it and the simulation.
const (
	DefaultMaxAttempts   = 3                // attempts in all, the first included
	DefaultMaxElapsed    = 30 * time.Second // the whole loop: attempts and waits
	DefaultMaxRetryAfter = 30 * time.Second // the longest Retry-After slept
)

// Config is the retry loop's part of a Transport's configuration.
type Config struct {
	MaxAttempts   int           // attempts in all; the last one is never retried
	Backoff       jitter.Config // the wait before each retry
	MaxRetryAfter time.Duration // a longer Retry-After stops the loop
}

// Input is what the loop knows after one attempt.
type Input struct {
	Outcome  retry.Decision // the attempt's outcome, classified
	Attempt  int            // attempts sent, this one included
	Canceled bool           // the caller's context has ended
	// Marked is true when the answer is a 5xx or 429 carrying the mark
	// "retried below: do not retry" (docs/CONTRACT.md, hop.Marked): a
	// service further down the chain has already retried this failure. The
	// mark on any other answer is no mark.
	Marked bool
	// Body is why the request body cannot be sent again
	// (retry.ReasonBodyNotRewindable), "" when it can.
	Body     retry.Reason
	Now      time.Time
	Deadline time.Time     // the overall deadline; zero for none
	PrevWait time.Duration // the wait before this attempt, 0 for the first
	// Rand returns the backoff's random value in [0, 1), called only when a
	// wait is computed; nil means math/rand/v2's Float64.
	Rand func() float64
}

// Result is the decision: retry after Wait when Stop is "", else stop.
type Result struct {
	Stop retry.Reason
	// Wait is the sleep before the retry: the backoff, or the server's
	// Retry-After when longer. When Stop is retry.ReasonDeadline,
	// retry.ReasonRetryAfterTooLong, or one of the commit step
	// (retry.ReasonBudget from Grant, retry.ReasonBodyNotRewindable from the
	// Transport's rewind), it is the wait that a retry would have needed.
	Wait time.Duration
	// Throttle is the outcome's retry.Decision.Throttle: what the retry
	// costs in the budget (Grant).
	Throttle bool
	// Cost is what the budget took for the retry (Grant), which a success
	// refunds and a retry never sent gives back (Refund).
	Cost int
	// BudgetLeft is what the budget had left when it refused the retry
	// (Stop retry.ReasonBudget).
	BudgetLeft int
}

// Decide returns whether the attempt described by in is retried, and
// changes nothing: it takes no budget and reads no body. Each stop is one
// case, checked in order: the outcome is not retryable; the answer is
// marked as retried below (no rule lifts that: the mark only ever makes a
// client retry less); the caller canceled; no attempt is left; the body
// cannot be sent again; the server's Retry-After is longer than
// c.MaxRetryAfter; the wait would not end before the deadline (no sleep in
// vain). A retry it grants is committed by Grant.
func Decide(c Config, in Input) Result {
	d := in.Outcome
	switch {
	case !d.Retry && (d.Class == retry.ClassCanceled || d.Class == retry.ClassCallerDeadline):
		return Result{Stop: retry.ReasonCanceled}
	case !d.Retry:
		return Result{Stop: retry.ReasonNotRetryable}
	case in.Marked:
		return Result{Stop: retry.ReasonRetriedBelow}
	case in.Canceled:
		return Result{Stop: retry.ReasonCanceled}
	case in.Attempt >= c.MaxAttempts:
		return Result{Stop: retry.ReasonMaxAttempts}
	case in.Body != "":
		return Result{Stop: in.Body}
	case d.HasRetryAfter && d.RetryAfter > c.MaxRetryAfter:
		return Result{Stop: retry.ReasonRetryAfterTooLong, Wait: d.RetryAfter}
	}
	r := in.Rand
	if r == nil {
		r = rand.Float64
	}
	wait := c.Backoff.Backoff(in.Attempt-1, in.PrevWait, d.Throttle, r())
	if d.HasRetryAfter {
		wait = max(wait, d.RetryAfter)
	}
	if !in.Deadline.IsZero() && wait >= in.Deadline.Sub(in.Now) { // no time left to try after it
		return Result{Stop: retry.ReasonDeadline, Wait: wait}
	}
	return Result{Wait: wait, Throttle: d.Throttle}
}

// Grant is the commit step of the retry r that Decide granted (r.Stop is
// ""; any other r is returned as it is): it takes the retry's cost from b,
// and returns r with that Cost, or, when b refuses, stopped with
// retry.ReasonBudget and what b had left. Call it last, once nothing else
// can stop the retry, so that a denial spends nothing in vain; a retry it
// granted that is then never sent gives its cost back with Refund.
func Grant(b budget.Budget, now time.Time, r Result) Result {
	if r.Stop != "" {
		return r
	}
	cost, ok := b.AcquireRetry(now, r.Throttle)
	if !ok {
		return Result{Stop: retry.ReasonBudget, Wait: r.Wait, Throttle: r.Throttle,
			BudgetLeft: b.Available(now)}
	}
	r.Cost = cost
	return r
}

// Refund gives back to b the cost that Grant took for a retry that was
// then never sent: the caller canceled during the wait, the deadline passed
// before it could start, or its preparation failed. A cost of 0 or less
// gives nothing.
func Refund(b budget.Budget, now time.Time, cost int) {
	if cost > 0 {
		b.Refund(now, cost)
	}
}

// HedgeInput is what the loop knows when an attempt in flight has gone
// without response headers for the hedge delay.
type HedgeInput struct {
	Sent     int  // attempts sent, hedges and retries included
	InFlight int  // attempts in flight
	Canceled bool // the caller's context has ended
	// Stopped is true once the call may hedge no more: an answer carried
	// the mark "retried below" or a Retry-After (never hedge after
	// pushback), or the budget refused a hedge.
	Stopped  bool
	Now      time.Time
	Deadline time.Time // the overall deadline; zero for none
}

// Hedge reports whether the attempts in flight described by in get one
// more beside them, a hedge, with at most maxHedges hedges in flight
// beside the attempt they hedge, and maxAttempts attempts in all (hedges
// and retries together). Like Decide it changes nothing: a hedge it grants
// is committed as a retry is (the body rewound, then Grant, last, with the
// cost of a transient retry), and a denial there stops hedging, never an
// attempt in flight.
func Hedge(maxAttempts, maxHedges int, in HedgeInput) bool {
	return !in.Stopped && !in.Canceled && in.InFlight > 0 && in.InFlight <= maxHedges &&
		in.Sent < maxAttempts && (in.Deadline.IsZero() || in.Now.Before(in.Deadline))
}

// Begin records in b that a logical request starts, before its attempt 1.
func Begin(b budget.Budget, now time.Time) { b.OnRequest(now) }

// End records in b how a call ended: status is its last answer's status,
// 0 when it ended without one. Only a success (a status below 400) feeds
// the budget, with cost, the cost of the retry that produced it (0 for a
// first try), as in the AWS SDKs: a 404 or a 422 is an answer, not a sign
// of health.
func End(b budget.Budget, now time.Time, status, cost int) {
	if status > 0 && status < 400 {
		b.OnSuccess(now, cost)
	}
}

// PushBack reports whether a call has had its failure retried, here or
// further down a chain of services, so that the request it was made for
// must not be retried above. The call stopped for reason stop after
// attempts attempts; status is its last answer's status, 0 when it ended
// without one, and marked whether that answer carries the mark. It pushes
// back when it gave up on a retryable failure: the attempts used up after
// retrying, or the budget, the deadline or a Retry-After longer than it
// honours refusing a retry (the first included); when it was retried and
// did not end in an answer below 500 but 429 (it ended in an error, a 5xx
// or a 429, whatever the stop); or when its last answer is a 5xx or 429
// carrying the mark (whatever the stop: a marked failure climbs the whole
// chain).
func PushBack(stop retry.Reason, attempts, status int, marked bool) bool {
	switch stop {
	case retry.ReasonBudget, retry.ReasonDeadline, retry.ReasonRetryAfterTooLong:
		return true
	case retry.ReasonMaxAttempts: // a retryable failure, the in-progress 409 included
		if attempts > 1 {
			return true
		}
	}
	return (marked || attempts > 1) && (status == 0 || hop.Failure(status))
}
