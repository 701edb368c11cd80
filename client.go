package saferetry

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/duelist"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// ErrAttemptTimeout is wrapped by the error of an attempt that ran out of its
// per-attempt time (WithAttemptTimeout) or hit the overall deadline
// (WithMaxElapsed) before its response headers arrived.
var ErrAttemptTimeout = errors.New("saferetry: attempt timed out")

// ErrInvalidKey is matched (errors.Is) by the error RoundTrip returns, before
// any network I/O, when the caller's idempotency key header is invalid: not
// 1 to 255 printable ASCII characters without spaces, or sent more than once.
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
// RoundTripper.
//
// A Transport is safe for concurrent use by many goroutines; build it with
// NewTransport. The zero value is not usable.
type Transport struct {
	base http.RoundTripper
	cfg  config

	// Injected for tests; defaults are the wall clock (nil now), a
	// timer-based sleep that honours cancellation, and math/rand/v2. The
	// attempts' time limits always run on the wall clock.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error
	rand  func() float64

	// fullDeadline is the deadline header value of a first attempt whose
	// overall deadline is MaxElapsed away (the common case): formatted once.
	fullDeadline string
	keyName      string // the key header's canonical name
	// The time limits of the attempts in flight.
	deadlines duelist.Shards[*attemptCtx]
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that sends each attempt through base (nil
// means http.DefaultTransport) with the defaults described on the Option
// functions: 3 attempts, full jitter (base 50 ms, 1 s for throttling, cap
// 20 s), 30 s overall, no per-attempt timeout, Retry-After honoured up to
// 30 s, automatic keys for POST and PATCH, the process-wide per-host token
// bucket budget, slog.Default() for logs.
func NewTransport(base http.RoundTripper, opts ...Option) *Transport {
	if base == nil {
		base = http.DefaultTransport
	}
	t := &Transport{
		base:  base,
		cfg:   defaultConfig(),
		sleep: sleepCtx,
		rand:  rand.Float64,
	}
	for _, o := range opts {
		if o != nil {
			o(&t.cfg)
		}
	}
	if t.cfg.budget == nil && t.cfg.registry == nil {
		t.cfg.registry = budget.Default()
	}
	t.fullDeadline = deadline.Format(t.cfg.maxElapsed)
	t.keyName = http.CanonicalHeaderKey(t.cfg.keyHeader)
	return t
}

// NewClient returns an *http.Client whose Transport is
// NewTransport(http.DefaultTransport, opts...). It sets no Client.Timeout:
// the overall deadline (WithMaxElapsed, default 30 s) and the request
// context bound the retry loop.
func NewClient(opts ...Option) *http.Client {
	return &http.Client{Transport: NewTransport(nil, opts...)}
}

// clock returns the current time of the retry loop.
func (t *Transport) clock() time.Time {
	if t.now == nil {
		return time.Now()
	}
	return t.now()
}

func sleepCtx(ctx context.Context, d time.Duration) error {
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

func (t *Transport) logger() *slog.Logger {
	if t.cfg.logger != nil {
		return t.cfg.logger
	}
	return slog.Default()
}

func (t *Transport) budgetFor(host string) budget.Budget {
	if t.cfg.budget != nil {
		return t.cfg.budget
	}
	return t.cfg.registry.For(host)
}

// call is the state of one logical request across its attempts.
type call struct {
	t          *Transport
	req        *http.Request // the caller's, never modified
	header     http.Header   // the caller's headers plus the key, shared by attempts
	key        string
	idempotent bool
	maxTries   int
	start      time.Time
	overall    time.Time
	bud        budget.Budget

	// The current attempt's timer and context, and the body of the
	// response delivered to the caller (call implements io.ReadCloser to
	// wrap it). The first attempt's context and request live here, so that
	// a request answered at once costs one allocation for all three.
	timer    *time.Timer // an attempt's own timer, when the queue cannot take it
	actx     *attemptCtx
	respBody io.ReadCloser
	hdrKey   [1]string // backing for the key header value
	hdrVal   [1]string // backing for the deadline header value
	actx1    attemptCtx
	req1     http.Request

	body        io.ReadCloser // the caller's body, for attempt 1 (nil once used)
	getBody     func() (io.ReadCloser, error)
	notRetrying string // why retries are off for the body, "" if they are not
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
	return c.run()
}

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
	vals := req.Header[t.keyName]
	if len(vals) == 0 && wantsKey {
		// A header set directly in the map under a non-canonical name
		// (req.Header["idempotency-key"]) is still the caller's key: never
		// add a second one beside it. (Only looked for where a key would
		// be added: the per-request cost stays off GETs.)
		for k, v := range req.Header {
			if len(v) > 0 && strings.EqualFold(k, name) {
				vals = v
				break
			}
		}
	}
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

	if t.cfg.deadlineHeader || addKey {
		// Our own map for the headers we add; the caller's value slices are
		// shared, never modified.
		c.header = shallowCopy(req.Header, 2)
		if addKey {
			c.hdrKey[0] = keygen.FormatHeader(c.key)
			c.header[t.keyName] = c.hdrKey[:]
		}
	} else {
		c.header = req.Header
	}

	if err := c.prepareBody(); err != nil {
		return nil, err
	}
	c.bud = t.budgetFor(req.URL.Host)
	// The loop's clock starts once the request is ready (its body read, if
	// it had to be buffered): attempt 1's time limit is queued from this
	// reading, and a stale one would push back the Transport's shared timer.
	c.start = t.clock()
	c.overall = deadline.Overall(ctx, c.start, t.cfg.maxElapsed)
	return c, nil
}

// prepareBody makes the request body replayable: GetBody when the caller gave
// one, otherwise a buffer of up to the configured limit.
func (c *call) prepareBody() error {
	req := c.req
	if req.Body == nil || req.Body == http.NoBody {
		return nil
	}
	c.body = req.Body
	if req.GetBody != nil {
		c.getBody = req.GetBody
		return nil
	}
	if c.maxTries == 1 {
		return nil // nothing to replay: send the body as it is
	}
	limit := min(c.t.cfg.bodyBufferLimit, math.MaxInt64-1) // limit+1 must not overflow
	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		return fmt.Errorf("saferetry: reading request body: %w", err)
	}
	if int64(len(buf)) > limit {
		// Too large to buffer: send it once, as a stream, and never retry.
		c.body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}
		c.notRetrying = retry.ReasonBodyNotRewindable
		c.t.logger().LogAttrs(req.Context(), slog.LevelInfo, "saferetry: request body too large to buffer; sent once without retries",
			slog.String("method", req.Method), slog.String("host", req.URL.Host), slog.String("path", req.URL.Path),
			slog.Int64("buffer_limit", limit))
		return nil
	}
	req.Body.Close()
	c.body = io.NopCloser(bytes.NewReader(buf))
	c.getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	return nil
}

func (c *call) run() (*http.Response, error) {
	t := c.t
	ctx := c.req.Context()
	c.bud.OnRequest(c.start)
	var (
		retryCost int
		prevWait  time.Duration
		lastErr   error
	)
	defer func() {
		if c.body != nil { // never sent: still ours to close
			c.body.Close()
		}
	}()
	attemptStart := c.start
	for n := 1; ; n++ {
		if n > 1 {
			attemptStart = t.clock()
		}
		resp, err := c.attempt(ctx, n, attemptStart)
		var now time.Time
		if t.now == nil {
			// The monotonic clock alone is half the price of time.Now;
			// the result is the same time, wall clock reading included.
			now = attemptStart.Add(time.Since(attemptStart))
		} else {
			now = t.clock()
		}
		timedOut := errors.Is(err, ErrAttemptTimeout)
		in := retry.Input{
			Method:          c.req.Method,
			Idempotent:      c.idempotent,
			Response:        resp,
			Err:             err,
			AttemptTimedOut: timedOut,
		}
		if resp != nil && resp.StatusCode == http.StatusConflict {
			in.ProblemCode = peekProblemCode(resp)
		}
		d := retry.Classify(retry.Policy{Retry500: t.cfg.retry500}, in, now)
		rec := attemptRecord{n: n, dec: d, resp: resp, err: err, elapsed: now.Sub(attemptStart), total: now.Sub(c.start)}

		if !d.Retry {
			if resp != nil {
				if resp.StatusCode < 400 {
					// Only a success feeds the budget (as in the AWS SDKs):
					// a 404 or a 422 is an answer, not a sign of health.
					c.bud.OnSuccess(now, retryCost)
				}
				rec.level = slog.LevelDebug
				if n > 1 || resp.StatusCode >= 500 {
					rec.level = slog.LevelInfo // after retries, or a server error: visible
				}
				c.log(ctx, rec, "final")
				return c.deliver(resp), nil
			}
			reason := retry.ReasonNotRetryable
			switch d.Class {
			case retry.ClassCanceled, retry.ClassDeadline:
				reason = retry.ReasonCanceled
			}
			rec.level = slog.LevelWarn
			c.log(ctx, rec, reason)
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
			rec.level = slog.LevelWarn
			c.log(ctx, rec, stop)
			if resp != nil {
				return c.deliver(resp), nil
			}
			return nil, &retry.ExhaustedError{Attempts: n, Reason: stop, Err: err, Key: c.key}
		}

		rec.level = slog.LevelInfo
		rec.wait = wait
		c.log(ctx, rec, "retry")
		if resp != nil {
			discard(resp)
		}
		c.endAttempt()
		prevWait = wait
		if err := t.sleep(ctx, wait); err != nil {
			cause := err
			if lastErr != nil {
				cause = errors.Join(err, lastErr)
			}
			return nil, &retry.ExhaustedError{Attempts: n, Reason: retry.ReasonCanceled, Err: cause, Key: c.key}
		}
	}
}

// attempt runs attempt n. The attempt's time limit (in the Transport's
// deadline lists, or a timer of its own) and context live on c until
// endAttempt (the response is discarded or an error returned) or until
// deliver hands the response to the caller.
func (c *call) attempt(ctx context.Context, n int, now time.Time) (*http.Response, error) {
	t := c.t
	var actx context.Context = ctx
	// The attempt is bounded by the per-attempt timeout and by the overall
	// deadline, whichever is first, unless the caller's own context already
	// ends first.
	limit := deadline.AttemptTimeout(now, c.overall, t.cfg.attemptTimeout)
	if ctxDeadline, ok := ctx.Deadline(); !ok || now.Add(limit).Before(ctxDeadline) {
		// A retry gets a fresh context: the base transport may still hold
		// the previous one. The limit targets this attempt's context only:
		// it may fire while the loop moves on to the next attempt.
		a := &c.actx1
		if n > 1 {
			a = new(attemptCtx)
		}
		wall := now // the wall clock's reading, unless a test injected one
		if t.now != nil {
			wall = time.Now()
		}
		a.parent = ctx
		c.actx = a
		if !t.deadlines.Add(&a.limit, a, wall.Add(limit), wall) {
			c.timer = time.AfterFunc(limit, a.Expire) // as the lists would
		}
		actx = a
	}
	var r *http.Request
	if n == 1 {
		c.req1 = *c.req.WithContext(actx) // a copy: no allocation of its own
		r = &c.req1
	} else {
		r = c.req.WithContext(actx)
	}
	if c.header != nil {
		h := c.header
		if t.cfg.deadlineHeader && !c.overall.IsZero() {
			if n == 1 {
				// No allocation for the common single attempt: the value
				// lives in c, and is formatted once per Transport when
				// the whole MaxElapsed is left.
				rem := deadline.Remaining(now, c.overall)
				c.hdrVal[0] = t.fullDeadline
				if rem != t.cfg.maxElapsed {
					c.hdrVal[0] = deadline.Format(rem)
				}
				h[deadline.Header] = c.hdrVal[:]
			} else {
				v := deadline.Format(deadline.Remaining(now, c.overall))
				// An earlier attempt's request may still be referenced by
				// the base transport: this one gets its own map and value.
				h = shallowCopy(h, 0)
				h[deadline.Header] = []string{v}
			}
		}
		r.Header = h
	}
	// Attempt 1 sends the caller's body; a retry sends the one run rewound
	// (GetBody) before it discarded the previous outcome. Each is sent once.
	r.Body, c.body = c.body, nil
	resp, err := t.base.RoundTrip(r)
	if err != nil {
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		if c.actx != nil && c.actx.canceledByTimer() && ctx.Err() == nil {
			cause := err
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				// The context error is the attempt's own limit: say so, and
				// keep it apart from the caller's deadline or cancellation.
				cause = ErrAttemptTimeout
			}
			err = fmt.Errorf("%w after %v: %w", ErrAttemptTimeout, limit, cause)
		}
		c.endAttempt()
		return nil, err
	}
	if resp == nil {
		c.endAttempt()
		return nil, errors.New("saferetry: base RoundTripper returned neither a response nor an error")
	}
	return resp, nil
}

// endAttempt ends the attempt's time limit and cancels its context.
func (c *call) endAttempt() {
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	if c.actx != nil {
		c.actx.limit.Remove()
		c.actx.cancel(context.Canceled, false)
		c.actx = nil
	}
}

// deliver hands resp to the caller. The attempt's time limit ends so that
// it cannot cut the body read; the attempt context is released when the caller
// closes the body, which c wraps (c is the body: no extra allocation).
func (c *call) deliver(resp *http.Response) *http.Response {
	if c.actx != nil {
		// The time limit bounded the wait for the headers; from now on
		// only the caller's context governs the body. Marked first, so a
		// limit that fires during the rest of this is ignored.
		c.actx.deliver()
	}
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	if c.actx == nil {
		return resp
	}
	c.actx.limit.Remove()
	if resp.Body == nil {
		c.endAttempt()
		return resp
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The body is the connection (an io.ReadWriteCloser): hand it over
		// unwrapped, and leave the attempt context alive with it.
		c.actx = nil
		return resp
	}
	c.respBody = resp.Body
	resp.Body = c
	return resp
}

// Read reads the delivered response body.
func (c *call) Read(p []byte) (int, error) { return c.respBody.Read(p) }

// Close closes the delivered response body and releases the attempt context.
func (c *call) Close() error {
	err := c.respBody.Close()
	if c.actx != nil {
		c.actx.cancel(context.Canceled, false)
	}
	return err
}

// shallowCopy copies h's map, sharing its value slices (never appended to),
// with room for extra more keys.
func shallowCopy(h http.Header, extra int) http.Header {
	c := make(http.Header, len(h)+extra)
	for k, v := range h {
		c[k] = v
	}
	return c
}

// discard drains a bounded amount of a response that will not be returned,
// so its connection can be reused, and closes it.
func discard(resp *http.Response) {
	if resp.Body == nil {
		return
	}
	_, _ = io.CopyN(io.Discard, resp.Body, drainLimit)
	resp.Body.Close()
}

// maxProblemPeek bounds how much of a 409 body is read to find its code.
const maxProblemPeek = 4 << 10

// peekProblemCode reads the "code" member of an application/problem+json 409
// without consuming the body for the caller: the bytes read are put back.
func peekProblemCode(resp *http.Response) string {
	if resp.Body == nil {
		return ""
	}
	mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if err != nil || mt != "application/problem+json" {
		return ""
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxProblemPeek))
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(buf), errReader{err}, resp.Body), resp.Body}
	if err != nil {
		return ""
	}
	return problemCode(buf)
}

// errReader replays a read error met while peeking, in its place.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	return 0, io.EOF
}

// problemCode extracts the "code" member of a problem+json document.
func problemCode(body []byte) string {
	var p struct {
		Code string `json:"code"`
	}
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	return p.Code
}

// attemptRecord is what one log record says about one attempt.
type attemptRecord struct {
	n            int
	dec          retry.Decision
	resp         *http.Response
	err          error
	elapsed      time.Duration
	total        time.Duration
	wait         time.Duration
	level        slog.Level
	budgetDenied bool
	budgetLeft   int
}

// log writes the one record of an attempt. outcome is "final", "retry" or
// the reason the loop stopped. The raw key never appears: only its digest.
func (c *call) log(ctx context.Context, a attemptRecord, outcome string) {
	l := c.t.logger()
	if !l.Enabled(ctx, a.level) {
		return
	}
	attrs := make([]slog.Attr, 0, 14)
	attrs = append(attrs,
		slog.Int("attempt", a.n),
		slog.String("method", c.req.Method),
		slog.String("host", c.req.URL.Host),
		slog.String("path", c.req.URL.Path),
		slog.String("class", a.dec.Class),
	)
	if a.resp != nil {
		attrs = append(attrs, slog.Int("status", a.resp.StatusCode))
	}
	if a.err != nil {
		attrs = append(attrs, slog.String("error", a.err.Error()))
	}
	attrs = append(attrs,
		slog.Duration("elapsed", a.elapsed),
		slog.Duration("total", a.total),
		slog.String("outcome", outcome),
	)
	if outcome == "retry" {
		attrs = append(attrs, slog.Duration("wait", a.wait))
	}
	if a.dec.HasRetryAfter {
		attrs = append(attrs, slog.Duration("retry_after", a.dec.RetryAfter))
	}
	if a.budgetDenied {
		attrs = append(attrs, slog.Int("budget_left", a.budgetLeft))
	}
	if c.key != "" {
		attrs = append(attrs, slog.String("key_digest", keygen.Digest(c.key)))
	}
	msg := "saferetry: attempt"
	switch {
	case outcome == "retry":
		msg = "saferetry: attempt failed, retrying"
	case a.level == slog.LevelWarn:
		msg = "saferetry: giving up"
	}
	l.LogAttrs(ctx, a.level, msg, attrs...)
}
