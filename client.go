package saferetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// ErrAttemptTimeout is wrapped by the error of an attempt that ran out of its
// per-attempt time (WithAttemptTimeout) or hit the overall deadline
// (WithMaxElapsed) before its response headers arrived. Such an error never
// matches context.DeadlineExceeded or context.Canceled, which are kept for
// the caller's own deadline and cancellation. It is also the cause
// (context.Cause) of an attempt's context that its time limit canceled.
var ErrAttemptTimeout = errors.New("saferetry: attempt timed out")

// ErrInvalidKey is matched (errors.Is) by the error RoundTrip returns, before
// any network I/O, when the caller's idempotency key header is invalid under
// keygen.ParseHeader: not 1 to 255 bytes of visible ASCII and inner spaces
// (a control character, a non-ASCII byte, too long, a malformed sf-string),
// or sent on more than one field line.
// errors.As with *keygen.InvalidKeyError gives the reason. It is the same
// sentinel as keygen.ErrInvalidKey.
var ErrInvalidKey = keygen.ErrInvalidKey

// Transport is an http.RoundTripper that retries what is safe to retry:
// only an allow-list of statuses (429, 502, 503, 504, the idempotency
// middleware's in-progress 409, and 500 when opted in) and errors
// (connection refused or reset, EOF before a response, per-attempt timeouts,
// refused HTTP/2 streams), with full-jitter backoff, under one overall
// deadline and a retry budget shared per host, logging every attempt. A POST
// or PATCH gets one Idempotency-Key before its first attempt, reused by every
// retry, so the server can de-duplicate them.
//
// Transport honours the http.RoundTripper contract: it never modifies the
// caller's request, always closes the request body, and returns the last
// response with a nil error whenever an attempt produced one (a 503 after the
// last attempt is returned as a response, not an error). When no attempt
// produced a response the error is a *retry.ExhaustedError that matches
// retry.ErrExhausted and wraps the last cause.
//
// Automatic keys make POST and PATCH retryable on every allow-listed
// outcome, timeouts included: that is safe only against a server that
// de-duplicates requests by Idempotency-Key (package idempotency, Stripe and
// others). Against a server that ignores the header, turn them off with
// WithAutoKeys(false), and unsafe requests are then retried only when they
// provably never left.
//
// When an attempt may have reached the server and the loop ends without a
// definitive answer (an error, a final 409 in progress, a 503), the outcome
// is unknown: send the request again later with the same key (from
// resp.Request.Header, or retry.ExhaustedError.Key), never with a new one.
// Best, set your own event-derived key (keygen.Event) so that a re-send after
// a restart carries it too.
//
// The overall deadline and the per-attempt timeout bound the retry loop
// until a response's headers arrive; reading the returned body is bounded
// only by the request's context (and http.Client.Timeout), as with any
// RoundTripper. The time left is sent to the server in the
// Request-Deadline-Ms header only when the request's context has a deadline
// (see WithDeadlineHeader).
//
// A Transport is safe for concurrent use by many goroutines; build it with
// NewTransport. The zero value is not usable.
type Transport struct {
	base    http.RoundTripper
	cfg     config
	keyName string // the key header's canonical name
	obs     observers

	// rand returns the random value of the backoff formula, in [0, 1):
	// math/rand/v2's, or a fixed value in tests.
	rand func() float64
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that sends each attempt through base (nil
// means http.DefaultTransport) with the defaults described on the Option
// functions: 3 attempts, full jitter (base 50 ms, 1 s for throttling, cap
// 20 s), 30 s overall, no per-attempt timeout, Retry-After honoured up to
// 30 s, automatic keys for POST and PATCH, the process-wide per-host token
// bucket budget, the deadline header only for requests whose context has a
// deadline, slog.Default() for logs.
func NewTransport(base http.RoundTripper, opts ...Option) *Transport {
	if base == nil {
		base = http.DefaultTransport
	}
	t := &Transport{base: base, cfg: defaultConfig(), rand: rand.Float64}
	for _, o := range opts {
		if o != nil {
			o(&t.cfg)
		}
	}
	if t.cfg.budget == nil && t.cfg.registry == nil {
		t.cfg.registry = budget.Default()
	}
	t.keyName = http.CanonicalHeaderKey(t.cfg.keyHeader)
	logs := logObserver{logger: t.cfg.logger, bufferLimit: t.cfg.bodyBufferLimit}
	t.obs = newObservers(append([]Observer{logs.observer()}, t.cfg.observers...))
	return t
}

// CloseIdleConnections closes the idle connections of the base transport
// when it has a CloseIdleConnections method (as *http.Transport has), so
// that http.Client.CloseIdleConnections works through a Transport. It does
// nothing otherwise. It is safe for concurrent use.
func (t *Transport) CloseIdleConnections() {
	if b, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		b.CloseIdleConnections()
	}
}

// NewClient returns an *http.Client whose Transport is
// NewTransport(http.DefaultTransport, opts...). It sets no Client.Timeout:
// the overall deadline (WithMaxElapsed, default 30 s) and the request
// context bound the retry loop.
func NewClient(opts ...Option) *http.Client {
	return &http.Client{Transport: NewTransport(nil, opts...)}
}

// RoundTrip sends req, retrying as described on Transport. See the type's
// documentation for the contract.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	c, err := t.newCall(req)
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	var end callEnd
	resp, err := c.run(&end)
	if t.obs.callDone {
		t.obs.doneCall(req.Context(), CallDoneInfo{Request: req, Key: c.key, Attempts: end.sent,
			Outcome: end.outcome, Response: resp, Err: err, Total: time.Since(c.start)})
	}
	return resp, err
}

// call is the state of one logical request across its attempts.
type call struct {
	t            *Transport
	req          *http.Request // the caller's, never modified
	header       http.Header   // the caller's headers plus the key, shared by attempts
	key          string
	idempotent   bool
	sendDeadline bool // each attempt carries deadline.Header
	maxTries     int
	start        time.Time
	overall      time.Time // the overall deadline
	bud          budget.Budget

	body        io.ReadCloser // the next attempt's request body (nil once sent)
	getBody     func() (io.ReadCloser, error)
	notRetrying string // why retries are off for the body, "" if they are not

	// The attempt in flight: its time limit and the cancellation of its
	// context, until endAttempt or deliver.
	timer  *time.Timer
	cancel context.CancelCauseFunc
}

// callEnd is how a call ended, for CallDone.
type callEnd struct {
	sent    int    // attempts sent
	outcome string // the last attempt's Outcome
}

func (c *call) run(end *callEnd) (*http.Response, error) {
	t := c.t
	ctx := c.req.Context()
	c.bud.OnRequest(c.start)
	var (
		retryCost int
		prevWait  time.Duration
		lastErr   error
		prevClass string // the class of the outcome the next attempt retries
	)
	defer func() {
		if c.body != nil { // never sent: still ours to close
			c.body.Close()
		}
	}()
	attemptStart := c.start
	for n := 1; ; n++ {
		if n > 1 {
			attemptStart = time.Now()
		}
		resp, octx, sent, err := c.attempt(ctx, n, prevClass, attemptStart)
		now := time.Now()
		done := func(rec attemptRecord, outcome string) {
			end.outcome = outcome
			c.done(octx, rec, outcome)
		}
		if !sent {
			// The preparation failed: nothing was sent, nothing to classify.
			done(attemptRecord{n: n, dec: retry.Decision{Class: retry.ClassNotRetryable}, err: err,
				elapsed: now.Sub(attemptStart), total: now.Sub(c.start)}, retry.ReasonPrepare)
			return nil, &retry.ExhaustedError{Attempts: n - 1, Reason: retry.ReasonPrepare, Err: err, Key: c.key}
		}
		end.sent = n
		timedOut := errors.Is(err, ErrAttemptTimeout)
		in := retry.Input{
			Method:          c.req.Method,
			Idempotent:      c.idempotent,
			Response:        resp,
			Err:             err,
			AttemptTimedOut: timedOut,
			Request:         c.req,
			Attempt:         n,
		}
		if resp != nil && resp.StatusCode == http.StatusConflict {
			in.ProblemCode = peekProblemCode(resp)
		}
		d := retry.Classify(retry.Policy{Retry500: t.cfg.retry500, Rules: t.cfg.rules}, in, now)
		rec := attemptRecord{n: n, dec: d, resp: resp, err: err, elapsed: now.Sub(attemptStart), total: now.Sub(c.start)}

		if !d.Retry {
			if resp != nil {
				if resp.StatusCode < 400 {
					// Only a success feeds the budget (as in the AWS SDKs):
					// a 404 or a 422 is an answer, not a sign of health.
					c.bud.OnSuccess(now, retryCost)
				}
				done(rec, OutcomeFinal)
				return c.deliver(resp), nil
			}
			reason := retry.ReasonNotRetryable
			switch d.Class {
			case retry.ClassCanceled, retry.ClassDeadline:
				reason = retry.ReasonCanceled
			}
			done(rec, reason)
			return nil, &retry.ExhaustedError{Attempts: n, Reason: reason, Err: err, Key: c.key}
		}
		if err != nil {
			lastErr = err
		}

		// The outcome is retryable: find out whether a retry may happen.
		stop := ""
		var wait time.Duration
		switch {
		case ctx.Err() != nil:
			stop = retry.ReasonCanceled
		case n >= c.maxTries:
			stop = retry.ReasonMaxAttempts
		case c.notRetrying != "":
			stop = c.notRetrying
		case d.HasRetryAfter && d.RetryAfter > t.cfg.retryAfterCap:
			stop = retry.ReasonDeadline
		}
		if stop == "" {
			wait = t.cfg.backoff.Backoff(n-1, prevWait, d.Throttle, t.rand())
			if d.HasRetryAfter && d.RetryAfter > wait {
				wait = d.RetryAfter
			}
			if !deadline.SleepFits(now, c.overall, wait) {
				stop = retry.ReasonDeadline
			}
		}
		if stop == "" && c.body == nil && c.getBody != nil {
			// Rewind the body now, before the outcome in hand is thrown
			// away: if that fails, the caller still gets it.
			nb, gerr := c.getBody()
			if gerr != nil {
				stop = retry.ReasonBodyNotRewindable
				err = errors.Join(err, fmt.Errorf("saferetry: rewinding request body: %w", gerr))
			} else {
				c.body = nb
			}
		}
		if stop == "" {
			kind := budget.Transient
			if d.Throttle {
				kind = budget.Throttle
			}
			cost, ok := c.bud.AcquireRetry(now, kind)
			if !ok {
				stop = retry.ReasonBudget
				rec.budgetLeft = c.bud.Available(now)
				rec.budgetDenied = true
			} else {
				retryCost = cost
			}
		}
		if stop != "" {
			done(rec, stop)
			if resp != nil {
				return c.deliver(resp), nil
			}
			return nil, &retry.ExhaustedError{Attempts: n, Reason: stop, Err: err, Key: c.key}
		}

		rec.wait = wait
		done(rec, OutcomeRetry)
		prevClass = d.Class
		if resp != nil {
			discard(resp)
		}
		c.endAttempt()
		prevWait = wait
		if err := sleep(ctx, wait); err != nil {
			cause := err
			if lastErr != nil {
				cause = errors.Join(err, lastErr)
			}
			end.outcome = retry.ReasonCanceled
			return nil, &retry.ExhaustedError{Attempts: n, Reason: retry.ReasonCanceled, Err: cause, Key: c.key}
		}
	}
}

// attempt prepares and sends attempt n, which starts at start and retries an
// outcome of class reason ("" for the first). octx is the context the
// observers' AttemptStart returned (ctx when none did); sent is false when
// the preparation failed (err is then the *PrepareError) and nothing was
// sent.
//
// The attempt's context is a child of octx, canceled when the caller's is,
// when the attempt's time limit ends (the per-attempt timeout or the overall
// deadline, whichever is first; cause ErrAttemptTimeout), and when the
// attempt is over: by endAttempt after an error or a discarded response, or
// when the caller closes the body of the response that deliver hands over.
func (c *call) attempt(ctx context.Context, n int, reason string, start time.Time) (resp *http.Response, octx context.Context, sent bool, err error) {
	t := c.t
	octx = ctx
	if t.obs.attemptStart {
		octx = t.obs.startAttempt(ctx, AttemptStartInfo{Request: c.req, Attempt: n, Key: c.key, RetryReason: reason, NotRetrying: c.notRetrying})
	}
	actx, cancel := context.WithCancelCause(octx)
	c.cancel = cancel
	// The time limit is a timer, not a deadline of the context: it is
	// stopped as soon as the response headers are in, so that it bounds the
	// wait for them and never the reading of the delivered body. When the caller's own
	// deadline comes first, that deadline alone ends the attempt, and the
	// error stays the caller's.
	limit := deadline.AttemptTimeout(start, c.overall, t.cfg.attemptTimeout)
	if d, ok := ctx.Deadline(); !ok || start.Add(limit).Before(d) {
		c.timer = time.AfterFunc(limit, func() { cancel(ErrAttemptTimeout) })
	}

	r := c.req.WithContext(actx)
	r.Header = c.header
	switch {
	case len(t.cfg.prepare) > 0:
		// The preparation may change headers and the URL: its own copies,
		// values included, so that the caller's never change.
		r.Header = c.header.Clone()
		if r.Header == nil {
			r.Header = make(http.Header, 1)
		}
		u := *c.req.URL
		r.URL = &u
		r.GetBody = c.getBody
	case c.sendDeadline:
		// Each attempt its own map: the base transport may still hold an
		// earlier attempt's request.
		r.Header = shallowCopy(c.header, 1)
	}
	if c.sendDeadline {
		r.Header[deadline.Header] = []string{deadline.Format(deadline.Remaining(start, c.overall))}
	}
	// Attempt 1 sends the caller's body; a retry sends the one run rewound
	// (GetBody) before it discarded the previous outcome. Each is sent once.
	r.Body, c.body = c.body, nil
	if len(t.cfg.prepare) > 0 {
		if err := prepare(t.cfg.prepare, r, n, c.header, t.cfg.keyHeader); err != nil {
			if r.Body != nil {
				r.Body.Close() // never sent: still ours to close
			}
			c.endAttempt()
			return nil, octx, false, err
		}
	}

	resp, err = t.base.RoundTrip(r)
	if err != nil {
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		if ctx.Err() == nil && context.Cause(actx) == ErrAttemptTimeout {
			err = attemptTimedOut(limit, err)
		}
		c.endAttempt()
		return nil, octx, true, err
	}
	if resp == nil {
		c.endAttempt()
		return nil, octx, true, errors.New("saferetry: base RoundTripper returned neither a response nor an error")
	}
	// The headers are in: stop the time limit now, so that it cannot cut
	// the body while the loop classifies the outcome and runs the rules and
	// observers. If it fired first, the attempt's context is canceled and
	// the body dead: the attempt timed out.
	if c.timer != nil {
		fired := !c.timer.Stop()
		c.timer = nil
		if fired {
			if resp.Body != nil {
				resp.Body.Close()
			}
			c.endAttempt()
			return nil, octx, true, attemptTimedOut(limit, context.Canceled)
		}
	}
	return resp, octx, true, nil
}

// done tells the observers attempt a's outcome; ctx is the attempt's
// context as AttemptStart made it.
func (c *call) done(ctx context.Context, a attemptRecord, outcome string) {
	if !c.t.obs.attemptDone {
		return
	}
	c.t.obs.doneAttempt(ctx, AttemptDoneInfo{
		Request: c.req, Attempt: a.n, Key: c.key, Decision: a.dec, Response: a.resp, Err: a.err,
		Elapsed: a.elapsed, Total: a.total, Outcome: outcome, Wait: a.wait,
		BudgetDenied: a.budgetDenied, BudgetLeft: a.budgetLeft,
	})
}

// attemptTimedOut is the error of an attempt that its own time limit ended:
// it matches ErrAttemptTimeout and keeps the base transport's error, unless
// that is only the context's cancellation, which must not read as the
// caller's.
func attemptTimedOut(limit time.Duration, err error) error {
	if errors.Is(err, ErrAttemptTimeout) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w after %v", ErrAttemptTimeout, limit)
	}
	return fmt.Errorf("%w after %v: %w", ErrAttemptTimeout, limit, err)
}

// endAttempt stops the attempt's time limit and cancels its context.
func (c *call) endAttempt() {
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	if c.cancel != nil {
		c.cancel(nil)
		c.cancel = nil
	}
}

// deliver hands resp to the caller. The attempt's time limit was stopped
// when its headers arrived (attempt), so it cannot cut the body; the
// attempt's context ends when the caller closes the body.
func (c *call) deliver(resp *http.Response) *http.Response {
	cancel := c.cancel
	c.cancel = nil
	switch {
	case resp.Body == nil:
		cancel(nil)
	case resp.StatusCode == http.StatusSwitchingProtocols:
		// The body is the connection (an io.ReadWriteCloser): handed over
		// unwrapped, with the attempt's context alive as long as the
		// caller's.
	default:
		resp.Body = &deliveredBody{ReadCloser: resp.Body, cancel: cancel}
	}
	return resp
}

// deliveredBody is the body of the response handed to the caller.
type deliveredBody struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

// Close closes the response body, then cancels the attempt's context.
func (b *deliveredBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

// sleep waits for d, or until ctx ends (its error is then returned).
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (t *Transport) budgetFor(host string) budget.Budget {
	if t.cfg.budget != nil {
		return t.cfg.budget
	}
	return t.cfg.registry.For(host)
}

// newCall checks req and fixes what all its attempts share: whether it may
// be retried, its key, its headers, a replayable body, its budget and its
// overall deadline. Its errors come before any I/O.
func (t *Transport) newCall(req *http.Request) (*call, error) {
	if req.URL == nil {
		return nil, errors.New("saferetry: request has no URL")
	}
	ctx := req.Context()
	c := &call{t: t, req: req, maxTries: t.cfg.maxAttempts}

	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	ov := overridesFrom(ctx)
	c.idempotent = retry.IsIdempotentMethod(method)
	switch ov.idempotency {
	case +1:
		c.idempotent = true
	case -1:
		c.idempotent = false
	}
	if ov.noRetry {
		c.maxTries = 1
	}

	name := t.cfg.keyHeader
	wantsKey := t.cfg.autoKeys && (method == http.MethodPost || method == http.MethodPatch)
	addKey := false
	// A header set directly in the map under a non-canonical name
	// (req.Header["idempotency-key"]) is still the caller's key: never add
	// a second one beside it, and check every spelling together, as the
	// server will see them (one field line each).
	vals := keyValues(req.Header, t.keyName, name)
	if len(vals) > 0 {
		// The caller's key: checked with the same wire rule as the server
		// (one field line, a bare token or an sf-string, 1..255 printable
		// ASCII), then sent exactly as the caller wrote it.
		key, err := keygen.ParseHeader(vals)
		if err != nil {
			return nil, fmt.Errorf("saferetry: %s header: %w", name, err)
		}
		c.key = key
	} else if wantsKey {
		key, ok := keygen.FromContext(ctx)
		if !ok {
			key = keygen.Random()
		}
		if err := keygen.Validate(key); err != nil {
			return nil, fmt.Errorf("saferetry: key from context: %w", err)
		}
		c.key, addKey = key, true
	}
	if c.key != "" && ov.idempotency >= 0 {
		c.idempotent = true // the server de-duplicates: every outcome may be retried
	}

	c.header = req.Header
	if addKey {
		// Our own map for the key; the caller's value slices are shared,
		// never modified.
		c.header = shallowCopy(req.Header, 1)
		c.header[t.keyName] = []string{keygen.FormatHeader(c.key)}
	}
	_, hasDeadline := ctx.Deadline()
	c.sendDeadline = t.cfg.deadlineHeader == deadlineAlways ||
		t.cfg.deadlineHeader == deadlineIfContext && hasDeadline

	if err := c.prepareBody(); err != nil {
		return nil, err
	}
	c.bud = t.budgetFor(req.URL.Host)
	// The loop's clock starts once the request is ready (its body read, if
	// it had to be buffered): the time spent reading the caller's body is
	// not taken from the attempts.
	c.start = time.Now()
	c.overall = deadline.Overall(ctx, c.start, t.cfg.maxElapsed)
	return c, nil
}

// attemptRecord is what the loop knows of one attempt, for its observers.
type attemptRecord struct {
	n            int
	dec          retry.Decision
	resp         *http.Response
	err          error
	elapsed      time.Duration
	total        time.Duration
	wait         time.Duration
	budgetDenied bool
	budgetLeft   int
}

// keyValues returns the values of the key header under every spelling of
// its name (canonical is its canonical form): on the wire each is a field
// line of the same field. The caller's slices are never modified.
func keyValues(h http.Header, canonical, name string) []string {
	vals := h[canonical]
	for k, v := range h {
		if k != canonical && len(v) > 0 && strings.EqualFold(k, name) {
			vals = append(vals[:len(vals):len(vals)], v...)
		}
	}
	return vals
}
