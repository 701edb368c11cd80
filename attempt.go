package saferetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"time"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/internal/resend"
	"github.com/saferetry/saferetry/retry"
)

// attempt is one try of a call: its context, that context's cancellation,
// the timer of its time limit, its outcome, and what it still owns. Its
// time limit covers everything the Transport does with the response
// (classify, rules, observers, peek) and stops only when the response is
// handed over (handOver), or set aside in a hedged round while other
// attempts run (hold); after that, the caller's context alone governs the
// body of a response handed over. The Transport's own reads of the body
// have bounds of their own as well: the peek at a 409 at most maxPeekTime,
// the drain of a discarded answer the wait before the retry.
//
// An attempt is torn down in one place: close, which every attempt not
// handed over goes through once and only once. Attempt 1 lives in its call
// (call.first); the others are allocated on their own.
type attempt struct {
	n      int  // its number; a re-send of the base transport's takes the next (resent)
	hedge  bool // sent beside attempts still in flight, not after one
	handed bool // the response is the caller's: close does nothing
	closed bool // close has run
	own    bool // req.Header is the attempt's own map, which a re-send renumbers in place
	// The sends of an attempt that the base transport may send again by
	// itself (resent.go): their count since it was prepared, which the
	// GotConn of trace, on its context, keeps, and when the last began,
	// after start.
	sends  int32
	resent time.Duration
	start  time.Time
	octx   context.Context // what the AttemptStart observers returned
	ctx    context.Context // the attempt's own, a child of octx
	cancel context.CancelCauseFunc
	until  time.Time   // the end of its time limit; zero for none
	timer  *time.Timer // cancels ctx at until; nil when the caller's deadline is as early
	req    *http.Request
	cost   int // what the budget took for it: a retry's or a hedge's cost, 0 for attempt 1

	// The outcome: the response or the error, its class, when the
	// response headers came and when it was classified.
	resp       *http.Response
	err        error
	d          retry.Decision
	answered   time.Time
	classified time.Time

	// body is what the attempt owns and close closes: the response body
	// until it is handed over (that of a response dropped for a timeout
	// included), or the request body of an attempt never sent.
	body io.ReadCloser

	trace httptrace.ClientTrace // on ctx when the base may send it again (watch)

	panicked any // what the base transport or a rule panicked with, on the attempt's goroutine
}

// begin prepares the call's next attempt, which retries an outcome of class
// retrying ("" for the first and for a hedge), on the goroutine of the
// loop: its number, its time limit, the AttemptStart observers, its own
// copy of the request with its headers and body, the preparation. cost is
// what the budget took for it (in c.unsent until it is sent). The error is
// the preparation's: the attempt is not sent, and the caller closes it.
// Otherwise the attempt counts as sent, and roundTrip sends it.
func (c *call) begin(ctx context.Context, retrying retry.Class, hedge bool,
	cost int) (*attempt, error) {
	t := c.t
	n := int(c.numbered.Add(1))
	a := &c.first // its start is the call's, set up before it
	if n > 1 {
		a = &attempt{start: time.Now()}
	}
	a.n, a.hedge, a.octx = n, hedge, ctx
	a.until = c.overall
	if d := t.cfg.attemptTimeout; d > 0 && (a.until.IsZero() || a.start.Add(d).Before(a.until)) {
		a.until = a.start.Add(d)
	}
	if t.obs.attemptStart {
		a.octx = c.startAttempt(ctx, AttemptStartInfo{Request: c.req, Attempt: n, Key: c.key,
			Retrying: retrying, NotRetrying: c.notRetrying, Hedge: hedge})
	}
	a.ctx, a.cancel = context.WithCancelCause(c.watch(a))
	// The limit is a timer, not a deadline of the context, so that it can
	// stop when the response is handed over. When the caller's own deadline
	// is as early, that deadline alone ends the attempt, and the error
	// stays the caller's.
	if d, ok := ctx.Deadline(); !a.until.IsZero() && (!ok || a.until.Before(d)) {
		a.timer = limit(time.Until(a.until), a.cancel)
	}

	r := c.req.WithContext(a.ctx)
	r.Header = c.header
	prep := len(t.cfg.prepare) > 0
	switch {
	case prep:
		// The preparation may change headers and the URL: its own copies,
		// values included, so that the caller's never change.
		r.Header = c.header.Clone()
		if r.Header == nil {
			r.Header = make(http.Header, 1)
		}
		u := *c.req.URL
		r.URL = &u
		r.GetBody = c.getBody
		a.own = true
	case c.sendDeadline || n > 1 && t.cfg.attemptHeader:
		// Each attempt its own map: the base transport may still hold an
		// earlier attempt's request.
		r.Header = cloneHeader(c.header)
		a.own = true
	}
	if c.sendDeadline {
		r.Header[deadline.Header] = timeLeft(c.overall, a.start)
	}
	if n > 1 && t.cfg.attemptHeader {
		r.Header[hop.AttemptHeader] = hop.AttemptValue(n) // attempt 1's is in c.header
	}
	// Attempt 1 sends the caller's body; a retry or a hedge the one its
	// commit step rewound. Each is sent once.
	r.Body, c.body = c.body, nil
	if prep {
		if err := prepare(t.cfg.prepare, r, n, c.header, t.cfg.keyHeader); err != nil {
			if r.Body != nil {
				a.body = r.Body // never sent: still ours to close
			}
			return a, c.redact(err)
		}
		a.sends = 0 // the preparation's own requests are not sends of the attempt
	}
	// net/http rewinds a body only through GetBody, which refuses
	// (resend.GetBody): it never sends an attempt with a body again by
	// itself, and the loop decides instead. One without a body it may send
	// again, and watch counts each send.
	r.GetBody = nil
	if r.Body != nil && r.Body != http.NoBody {
		r.GetBody = resend.GetBody
	}
	a.req, a.cost = r, cost
	c.unsent -= cost
	c.sent.Add(1)
	return a, nil
}

// sendStart is when attempt a's last send began: its start, or a
// re-send's.
func (a *attempt) sendStart() time.Time { return a.start.Add(a.resent) }

// timeLeft is the deadline.Header value of a send at now, before the
// overall deadline: the whole milliseconds left, rounded down, at least 0.
func timeLeft(overall, now time.Time) []string {
	ms := max(0, overall.Sub(now)/time.Millisecond)
	return []string{strconv.FormatInt(int64(ms), 10)}
}

// roundTrip sends attempt a through the base transport and classifies its
// outcome. It touches nothing of the call but what is read-only, so that
// attempts in flight at once each run it on a goroutine of their own.
func (c *call) roundTrip(a *attempt) {
	a.resp, a.err = c.t.base.RoundTrip(a.req)
	a.answered = time.Now()
	switch {
	case a.err != nil:
		if a.resp != nil {
			a.body = a.resp.Body // a base that broke the contract: closed all the same
		}
		a.resp = nil
		if errors.Is(a.err, resend.Err) {
			a.err = &retry.ResendError{MayHaveArrived: resend.Replays(a.req)}
		}
		if a.expired() {
			a.err = attemptTimedOut(a.until.Sub(a.start), a.err)
		}
	case a.resp == nil:
		a.err = errors.New("saferetry: base RoundTripper returned neither a response nor an error")
	default:
		a.body = a.resp.Body
		if a.expired() {
			a.timeOut() // the headers came after the limit: the body is dead
		}
	}
	a.err = c.redact(a.err)
	a.d = c.classify(a)
}

// limit returns a timer that cancels an attempt's context, with the cause
// ErrAttemptTimeout, after d.
func limit(d time.Duration, cancel context.CancelCauseFunc) *time.Timer {
	return time.AfterFunc(d, func() { cancel(ErrAttemptTimeout) })
}

// expired reports whether the attempt's time limit has ended it while the
// caller's context is still alive.
func (a *attempt) expired() bool {
	return context.Cause(a.ctx) == ErrAttemptTimeout && a.octx.Err() == nil
}

// timeOut makes the attempt a timed-out one, its time limit or the peek's
// having ended: its response, if any, is dropped (its body stays the
// attempt's, for close).
func (a *attempt) timeOut() {
	a.resp = nil
	a.err = attemptTimedOut(time.Since(a.start), nil)
}

// hold stops the attempt's time limit, its response in hand: for the
// caller (handOver), or set aside while other attempts of a hedged round
// are in flight, whose own limits then bound the wait. It reports false,
// the response dropped, when the limit ended first: the attempt timed out.
func (a *attempt) hold() bool {
	if a.timer != nil && !a.timer.Stop() {
		a.timeOut()
		return false
	}
	a.timer = nil
	return true
}

// handOver gives attempt a's response to the caller: its time limit stops
// (hold), and its context ends when the caller closes the body (the call's
// delivered body), which also ends what is left of the hedged rounds. It
// reports false, the response dropped, when the limit ended first: the
// attempt timed out. A second call reports true and does nothing.
func (c *call) handOver(a *attempt) bool {
	if a.handed {
		return true
	}
	if !a.hold() {
		return false
	}
	a.handed, a.body = true, nil
	switch {
	case a.resp.Body == nil:
		a.cancel(nil)
	case a.resp.StatusCode == http.StatusSwitchingProtocols:
		// The body is the connection (an io.ReadWriteCloser): handed over
		// unwrapped, with the attempt's context alive as long as the
		// caller's.
	default:
		c.delivered = deliveredBody{ReadCloser: a.resp.Body, cancel: a.cancel, hedge: c.hedge}
		a.resp.Body = &c.delivered
	}
	return true
}

// close tears down an attempt that was not handed over, in one place: its
// time limit stops; the response body it owns is drained, so that the
// connection can be reused, and closed; the request body of an attempt
// never sent is closed; its context is canceled. The drain runs within the
// wait before the retry: it stops at drainUntil (a zero or past time: no
// drain), or after maxDrain bytes, whichever comes first; an unfinished
// body is then closed and its connection dropped. Later calls do nothing.
func (a *attempt) close(drainUntil time.Time) {
	if a.handed || a.closed {
		return
	}
	a.closed = true
	if a.timer != nil {
		a.timer.Stop()
	}
	if a.body != nil {
		if d := time.Until(drainUntil); d > 0 && a.resp != nil {
			drain := time.AfterFunc(d, func() { a.cancel(nil) })
			_, _ = io.Copy(io.Discard, io.LimitReader(a.body, maxDrain))
			drain.Stop()
		}
		a.body.Close()
	}
	a.cancel(nil)
}

// attemptTimedOut is the error of an attempt that its own time limit ended:
// it matches ErrAttemptTimeout and keeps the base transport's error, unless
// that is only the context's cancellation, which must not read as the
// caller's.
func attemptTimedOut(limit time.Duration, err error) error {
	if err == nil || errors.Is(err, ErrAttemptTimeout) || errors.Is(err, context.Canceled) ||
		errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w after %v", ErrAttemptTimeout, limit)
	}
	return fmt.Errorf("%w after %v: %w", ErrAttemptTimeout, limit, err)
}

// deliveredBody is the body of the response handed to the caller.
type deliveredBody struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
	hedge  *hedging // the call's hedged rounds, nil for none
}

// Close closes the response body, cancels the attempt's context, and ends
// what is left of the hedged rounds: the drains of the answers they
// discarded.
func (b *deliveredBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	b.hedge.end()
	return err
}
