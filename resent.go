package saferetry

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"time"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/internal/resend"
	"github.com/saferetry/saferetry/retry"
)

// watch returns the parent of attempt a's own context: a.octx, with a
// trace whose GotConn tells each send of a (connected), when the base
// transport may send a again by itself. net/http does so only for an
// attempt without a body: one with a body carries the GetBody that
// refuses (resend.GetBody), and a preparation never changes the body. The
// trace composes with any the caller put on the request's context.
func (c *call) watch(a *attempt) context.Context {
	if c.body != nil && c.body != http.NoBody {
		return a.octx
	}
	a.trace = httptrace.ClientTrace{GotConn: func(httptrace.GotConnInfo) { c.connected(a) }}
	return httptrace.WithClientTrace(a.octx, &a.trace)
}

// connected is GotConn of attempt a's trace: the base transport took a
// connection to send a, which net/http does once per send, before it
// writes the request, on the goroutine that sends a. A send after the
// first is a re-send of the base transport's (resent).
func (c *call) connected(a *attempt) {
	a.sends++
	if a.sends > 1 {
		c.resent(a)
	}
}

// resent makes a re-send of attempt a by the base transport an attempt of
// its own, before it is written: the send before it is told to the
// AttemptDone observers as an attempt retried at once (class
// retry.ClassResend); the re-send takes the call's next number, counts
// toward WithMaxAttempts, is charged to the retry budget as a transient
// retry (when the budget has the tokens: the re-send is on its way and
// cannot be refused), is told to the AttemptStart observers, and carries
// its own Request-Attempt and Request-Deadline-Ms. It runs on the goroutine
// that sends a, a hedge's beside the loop: it changes only a, the call's
// counters (atomic) and the budget (safe for concurrent use), and tells the
// observers under c.mu.
func (c *call) resent(a *attempt) {
	now := time.Now()
	may := resend.Replays(a.req)
	a.d = retry.Decision{Class: retry.ClassResend, NeverSent: !may, Retry: true}
	a.err = &retry.ResendError{MayHaveArrived: may, Resent: true}
	c.observe(a, OutcomeRetry, decide.Result{}, now)
	a.d, a.err = retry.Decision{}, nil

	a.cost = decide.Grant(c.bud, now, decide.Result{}).Cost
	n := int(c.numbered.Add(1))
	c.sent.Add(1)
	a.n, a.resent = n, now.Sub(a.start)
	if c.t.obs.attemptStart {
		a.octx = c.startAttempt(c.req.Context(), AttemptStartInfo{Request: c.req, Attempt: n,
			Key: c.key, Retrying: retry.ClassResend, Hedge: a.hedge})
	}
	c.renumber(a, n, now)
}

// renumber gives attempt a's request the fields of its send n at now: its
// Request-Attempt, and the time left in Request-Deadline-Ms. net/http
// writes that request after GotConn returns, on the same goroutine or one
// it hands the request to. A map the attempt shares (the call's, which
// later attempts copy) is copied first, and the copy put in the request,
// which net/http sends as it is when it has no body.
func (c *call) renumber(a *attempt, n int, now time.Time) {
	if !c.t.cfg.attemptHeader && !c.sendDeadline {
		return
	}
	h := a.req.Header
	if !a.own {
		h, a.own = cloneHeader(h), true
	}
	if c.t.cfg.attemptHeader {
		h[hop.AttemptHeader] = hop.AttemptValue(n)
	}
	if c.sendDeadline {
		h[deadline.Header] = timeLeft(c.overall, now)
	}
	a.req.Header = h
}
