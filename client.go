package saferetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/internal/hosts"
	"github.com/saferetry/saferetry/internal/latency"
	"github.com/saferetry/saferetry/internal/nilcheck"
	"github.com/saferetry/saferetry/internal/wait"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// ErrAttemptTimeout is wrapped by the error of an attempt that its own time
// limit ended: the per-attempt timeout (WithAttemptTimeout) or the overall
// deadline (WithMaxElapsed), reached before the Transport handed the
// response over, or the 1 s bound of the peek at a 409's problem code. It
// never matches context.DeadlineExceeded or context.Canceled, which are
// kept for the caller's own deadline and cancellation. It is also the cause
// (context.Cause) of the context of an attempt that its limit ended.
var ErrAttemptTimeout = errors.New("saferetry: attempt timed out")

// Transport is an http.RoundTripper that retries what is safe to retry, as
// the package documentation describes: the allow-list, the keys, the
// deadlines, the budget and the defaults.
//
// It honours the http.RoundTripper contract: it never modifies the caller's
// request, always closes the request body, and returns the last response
// with a nil error whenever an attempt produced one (a 503 after the last
// attempt is a response, not an error). Otherwise the error is a
// *retry.ExhaustedError that matches retry.ErrExhausted and wraps the last
// cause.
//
// A Transport is safe for concurrent use by many goroutines; build it with
// NewTransport. The zero value is not usable.
type Transport struct {
	base    http.RoundTripper
	cfg     config
	keyName string // the key header's canonical name
	keyErr  error  // why the key header's name is refused, nil when it is not
	obs     observers
	// The hosts' latencies, for an adaptive hedge delay (hedge.go); nil for
	// none. At most hosts.Max (4096) hosts have one of their own.
	est *hosts.Map[*latency.Estimate]
}

var _ http.RoundTripper = (*Transport)(nil)

// defaultBudget is the budget of every Transport built without WithBudget:
// one token bucket per host, shared process-wide.
var defaultBudget = sync.OnceValue(func() *budget.Registry { return budget.NewRegistry(nil) })

// hostBudgets is a Budget that gives each host a budget of its own, as
// *budget.Registry does (see WithBudget).
type hostBudgets interface {
	For(host string) budget.Budget
}

// NewTransport returns a Transport that sends each attempt through base,
// configured by opts (the defaults are in the package documentation), in
// order; a nil Option is skipped. A nil base, typed nil pointers included,
// means http.DefaultTransport. It never fails and never panics.
func NewTransport(base http.RoundTripper, opts ...Option) *Transport {
	if nilcheck.Is(base) {
		base = http.DefaultTransport
	}
	t := &Transport{base: base, cfg: defaultConfig()}
	for _, o := range opts {
		if o != nil {
			o(&t.cfg)
		}
	}
	if nilcheck.Is(t.cfg.budget) {
		t.cfg.budget = defaultBudget()
	}
	t.keyName = http.CanonicalHeaderKey(t.cfg.keyHeader)
	t.keyErr = checkKeyHeader(t.cfg.keyHeader)
	if t.cfg.hedging && t.cfg.hedge.MaxHedges >= 0 && t.cfg.hedge.Delay <= 0 {
		t.est = &hosts.Map[*latency.Estimate]{New: latency.New}
	}
	obs := t.cfg.observers
	if !t.cfg.noLog {
		logs := logObserver{logger: t.cfg.logger, maxBody: t.cfg.maxBufferedBody}
		obs = append([]Observer{logs.observer()}, obs...)
	}
	t.obs = newObservers(obs)
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
// the overall deadline (WithMaxElapsed) and the request's context bound the
// retry loop.
func NewClient(opts ...Option) *http.Client {
	return &http.Client{Transport: NewTransport(nil, opts...)}
}

// RoundTrip sends req, retrying as described on Transport.
func (t *Transport) RoundTrip(req *http.Request) (resp *http.Response, err error) {
	c := &call{t: t, req: req, body: req.Body}
	defer c.finish(&resp, &err)
	if t.keyErr != nil {
		return nil, t.keyErr
	}
	if err := c.setUp(); err != nil {
		return nil, err
	}
	return c.follow(c.run())
}

// call is one logical request across its attempts.
type call struct {
	t            *Transport
	req          *http.Request // the caller's, never modified
	header       http.Header   // the caller's headers plus the key, shared by attempts
	key          string
	idempotent   bool
	sendDeadline bool // each attempt carries deadline.Header
	maxAttempts  int
	overall      time.Time // the overall deadline; zero for none
	bud          budget.Budget
	hedge        *hedging // the hedged rounds (hedge.go); nil when the call does not hedge

	// body is the next attempt's request body: the caller's until attempt 1
	// takes it, nil once sent; finish closes one never sent.
	body        io.ReadCloser
	getBody     func() (io.ReadCloser, error)
	notRetrying retry.Reason // why the body cannot be sent again, "" if it can

	// The attempts begun (the number of the last one) and sent, a re-send
	// of the base transport's included (resent.go), which may count one
	// on the goroutine of a hedge in flight; mu keeps the observers' calls
	// of one call from running at once.
	numbered atomic.Int32
	sent     atomic.Int32
	mu       sync.Mutex
	unsent   int // what the budget took for attempts not sent: finish gives it back

	// How the call ends, for finish: the attempt it ends with, what the
	// loop did with it and why, and when.
	last    *attempt
	outcome Outcome
	stop    retry.Reason
	ended   time.Time

	// first is attempt 1 (the others are allocated on their own); its
	// start is the call's (start).
	first     attempt
	delivered deliveredBody // the body of the response handed over (handOver)
}

// start is when the loop's clock started, and attempt 1 with it.
func (c *call) start() time.Time { return c.first.start }

// run is the retry loop: attempt (with its hedges, hedge.go), classify,
// decide, then wait and go on, or return what the call ends with, which
// finish then ends.
func (c *call) run() (*http.Response, error) {
	ctx := c.req.Context()
	decide.Begin(c.bud, c.start())
	var (
		retrying retry.Class // the class of the outcome the next attempt retries
		prevWait time.Duration
		cost     int // the budget cost of the next attempt, a retry
		lastErr  error
	)
	for {
		if c.numbered.Load() > 0 && !c.overall.IsZero() && !time.Now().Before(c.overall) {
			// No time left for the retry (an observer took it): it is
			// neither sent nor counted.
			return c.stopped(retry.ReasonDeadline, lastErr)
		}
		a, err := c.begin(ctx, retrying, false, cost)
		c.last = a
		if err != nil { // the preparation failed: nothing was sent
			a.d, a.err = retry.Decision{Class: retry.ClassNotRetryable}, err
			c.observe(a, OutcomeStopped, decide.Result{Stop: retry.ReasonPrepare}, time.Now())
			return c.stopped(retry.ReasonPrepare, err)
		}
		if c.hedge != nil {
			a = c.hedge.round(ctx, a)
			c.last = a
		} else {
			c.roundTrip(a)
		}
		step, now := c.judge(a, prevWait)
		for step.Stop != "" && a.resp != nil && !c.handOver(a) {
			a.d = c.classify(a) // the limit fired first: the attempt timed out
			step, now = c.judge(a, prevWait)
		}
		if step.Stop != "" {
			return c.end(a, step, now)
		}
		c.observe(a, OutcomeRetry, step, now)
		if a.err != nil {
			lastErr = a.err
		}
		// The wait starts at the decision: the drain runs within it, and
		// the sleep is what is left of it.
		wake := now.Add(step.Wait)
		a.close(wake)
		c.unsent += step.Cost
		if err := wait.Sleep(ctx, time.Until(wake)); err != nil {
			if lastErr != nil {
				err = errors.Join(err, lastErr)
			}
			return c.stopped(retry.ReasonCanceled, err)
		}
		retrying, prevWait, cost = a.d.Class, step.Wait, step.Cost
	}
}

// end ends the loop with attempt a, as step decided at now: its response,
// handed over, with a nil error, or else its error.
func (c *call) end(a *attempt, step decide.Result, now time.Time) (*http.Response, error) {
	c.outcome, c.stop, c.ended = OutcomeStopped, step.Stop, now
	if !a.d.Retry {
		c.outcome = OutcomeFinal
	}
	c.observe(a, c.outcome, step, now)
	if a.resp != nil {
		return a.resp, nil
	}
	return nil, &retry.ExhaustedError{Attempts: int(c.sent.Load()), Reason: step.Stop, Err: a.err,
		Key: c.key}
}

// stopped ends the loop, for reason, before an attempt could be judged:
// the error wraps err.
func (c *call) stopped(reason retry.Reason, err error) (*http.Response, error) {
	c.outcome, c.stop = OutcomeStopped, reason
	return nil, &retry.ExhaustedError{Attempts: int(c.sent.Load()), Reason: reason, Err: err,
		Key: c.key}
}

// finish is the call's one exit, deferred by RoundTrip, and the only place
// that ends a call: it closes the request body no attempt took (the
// caller's, when RoundTrip fails before attempt 1), gives back what the
// budget took for attempts never sent, closes the last attempt unless its
// response was handed over, tells the budget how the call ended, notes a
// pushback (decide.PushBack) in the record of the request the call was
// made for when its context carries one (deadline.Middleware), ends what is
// left of the hedged rounds unless the body returned took it, and tells
// the CallDone observers. A panic that unwinds through it (the base
// transport's, a rule's) is not told to them.
func (c *call) finish(resp **http.Response, err *error) {
	if c.body != nil {
		c.body.Close()
	}
	if c.numbered.Load() == 0 {
		return // refused before any attempt
	}
	if c.ended.IsZero() {
		c.ended = time.Now()
	}
	decide.Refund(c.bud, c.ended, c.unsent)
	c.last.close(time.Time{})
	if c.delivered.hedge == nil {
		c.hedge.end() // no body took the hedged rounds
	}
	if *resp == nil && *err == nil {
		return // a panic unwinds through RoundTrip
	}
	status := 0
	if *resp != nil {
		status = (*resp).StatusCode
		decide.End(c.bud, c.ended, status, c.last.cost)
	}
	sent := int(c.sent.Load())
	if decide.PushBack(c.stop, sent, status, hop.Marked(*resp)) {
		if rec := hop.FromContext(c.req.Context()); rec != nil {
			rec.NoteRetriedBelow()
		}
	}
	if c.t.obs.callDone {
		c.t.obs.doneCall(c.req.Context(), CallDoneInfo{Request: c.req, Key: c.key,
			Attempts: sent, Outcome: c.outcome, Stop: c.stop, Response: *resp, Err: *err,
			Total: c.ended.Sub(c.start())})
	}
}

// judge decides what follows attempt a's classified outcome, at the time
// it returns: the decision (decide.Decide), then, for a retry, its commit
// step (commit).
func (c *call) judge(a *attempt, prevWait time.Duration) (decide.Result, time.Time) {
	cfg := &c.t.cfg
	now := time.Now()
	step := decide.Decide(decide.Config{MaxAttempts: c.maxAttempts, Backoff: cfg.backoff,
		MaxRetryAfter: cfg.maxRetryAfter}, decide.Input{
		Outcome: a.d, Attempt: int(c.sent.Load()), Canceled: c.req.Context().Err() != nil,
		Marked: hop.Marked(a.resp), Body: c.notRetrying,
		Now: now, Deadline: c.overall, PrevWait: prevWait,
	})
	step, err := c.commit(step, now)
	if err != nil && a.resp == nil {
		// An attempt without a response carries the error (with a
		// response in hand, that is what the caller gets).
		rewind := fmt.Errorf("saferetry: rewinding request body: %w", err)
		a.err = errors.Join(a.err, c.redact(rewind))
	}
	return step, now
}

// commit is the commit step of the retry or the hedge that step grants (any
// other step is returned as it is): the request body is rewound from
// GetBody, then the budget asked, last (decide.Grant), so that a retry
// stopped for any other reason costs nothing. When GetBody fails, the
// request is never sent again: the step stops with
// retry.ReasonBodyNotRewindable, and the error is GetBody's.
func (c *call) commit(step decide.Result, now time.Time) (decide.Result, error) {
	if step.Stop != "" {
		return step, nil
	}
	// A body in hand was rewound for a step the budget refused (before an
	// attempt's limit fired, or for a hedge): it has not been sent.
	if c.getBody != nil && c.body == nil {
		body, err := c.getBody()
		if err != nil {
			c.notRetrying = retry.ReasonBodyNotRewindable
			return decide.Result{Stop: retry.ReasonBodyNotRewindable, Wait: step.Wait,
				Throttle: step.Throttle}, err
		}
		c.body = body
	}
	return decide.Grant(c.bud, now, step), nil
}

// classify labels attempt a's outcome. A 409's problem code is peeked from
// its body under the attempt's time limit and maxPeekTime; if either ends
// meanwhile, the attempt timed out.
func (c *call) classify(a *attempt) retry.Decision {
	in := retry.Input{Idempotent: c.idempotent, Request: c.req, Attempt: a.n}
	a.classified = a.answered
	if a.resp != nil && a.resp.StatusCode == http.StatusConflict {
		peek := time.AfterFunc(maxPeekTime, func() { a.cancel(ErrAttemptTimeout) })
		in.ProblemCode = peekProblemCode(a.resp)
		a.body = a.resp.Body // the peeked bytes put back in front of it
		if !peek.Stop() || a.expired() {
			a.timeOut()
		}
		a.classified = time.Now()
	}
	in.Response, in.Err = a.resp, a.err
	in.AttemptTimedOut = errors.Is(a.err, ErrAttemptTimeout)
	return retry.Classify(c.t.cfg.rules, in, a.classified)
}

// observe tells the AttemptDone observers attempt a's outcome and what the
// loop does next, at now. For OutcomeLost it reads nothing of a's outcome:
// the attempt was canceled, and what it ended with is no answer.
func (c *call) observe(a *attempt, outcome Outcome, step decide.Result, now time.Time) {
	if !c.t.obs.attemptDone {
		return
	}
	info := AttemptDoneInfo{Request: c.req, Attempt: a.n, Key: c.key, Hedge: a.hedge,
		Elapsed: now.Sub(a.sendStart()), Total: now.Sub(c.start()), Outcome: outcome, Stop: step.Stop}
	if outcome != OutcomeLost {
		info.Decision, info.Response, info.Err = a.d, a.resp, a.err
		if !a.classified.IsZero() {
			info.Elapsed = a.classified.Sub(a.sendStart())
		}
	}
	switch {
	case outcome == OutcomeRetry:
		info.Wait = step.Wait
	case step.Stop == retry.ReasonBudget:
		info.BudgetLeft = step.BudgetLeft
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t.obs.doneAttempt(a.octx, info)
}

// startAttempt tells the AttemptStart observers that an attempt starts,
// and returns the context they return.
func (c *call) startAttempt(ctx context.Context, info AttemptStartInfo) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t.obs.startAttempt(ctx, info)
}

// setUp checks the caller's request and fixes what all its attempts share:
// whether it may be retried, its key, its headers, a replayable body, its
// budget, its overall deadline and its hedging. Its errors come before any
// I/O.
func (c *call) setUp() error {
	t, req := c.t, c.req
	if req.URL == nil {
		return errors.New("saferetry: request has no URL")
	}
	ctx := req.Context()
	c.maxAttempts = t.cfg.maxAttempts

	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	ov := overridesFrom(ctx)
	c.idempotent = idempotentMethod(method)
	switch ov.idempotency {
	case +1:
		c.idempotent = true
	case -1:
		c.idempotent = false
	}
	if ov.noRetry {
		c.maxAttempts = 1
	}

	wantsKey := t.cfg.autoKeys && (method == http.MethodPost || method == http.MethodPatch)
	addKey := false
	// A header set directly in the map under a non-canonical name
	// (req.Header["idempotency-key"]) is still the caller's key: never add
	// a second one beside it, and check every spelling together, as the
	// server will see them (one field line each).
	if vals := keyValues(req.Header, t.keyName, t.cfg.keyHeader); len(vals) > 0 {
		// The caller's key: checked with the server's wire rule, then sent
		// exactly as the caller wrote it.
		key, err := keygen.ParseHeader(vals)
		if err != nil {
			return fmt.Errorf("saferetry: %s header: %w", t.cfg.keyHeader, err)
		}
		c.key = key
	} else if wantsKey {
		key, ok := keygen.FromContext(ctx)
		if !ok {
			key = keygen.Random()
		}
		if err := keygen.Validate(key); err != nil {
			return fmt.Errorf("saferetry: key from context: %w", err)
		}
		c.key, addKey = key, true
	}
	if c.key != "" && ov.idempotency >= 0 {
		c.idempotent = true // the server de-duplicates: every outcome may be retried
	}

	c.header = req.Header
	if addKey || t.cfg.attemptHeader {
		// Our own map for the key and the first attempt's number; the
		// caller's value slices are shared, never modified.
		c.header = cloneHeader(req.Header)
		if addKey {
			c.header[t.keyName] = []string{keygen.FormatHeader(c.key)}
		}
		if t.cfg.attemptHeader {
			c.header[hop.AttemptHeader] = hop.AttemptValue(1)
		}
	}
	ctxDeadline, hasDeadline := ctx.Deadline()
	c.sendDeadline = t.cfg.deadlineHeader == deadlineAlways ||
		t.cfg.deadlineHeader == deadlineIfContext && hasDeadline

	if err := c.prepareBody(); err != nil {
		return err
	}
	c.bud = t.cfg.budget
	if hosts, ok := c.bud.(hostBudgets); ok {
		c.bud = hosts.For(req.URL.Host)
		if nilcheck.Is(c.bud) {
			c.bud = defaultBudget().For(req.URL.Host)
		}
	}
	// The loop's clock starts once the request is ready (its body read, if
	// it had to be buffered): the time spent reading the caller's body is
	// not taken from the attempts.
	c.first.start = time.Now()
	if t.cfg.maxElapsed > 0 {
		c.overall = c.first.start.Add(t.cfg.maxElapsed)
	}
	if hasDeadline && (c.overall.IsZero() || ctxDeadline.Before(c.overall)) {
		c.overall = ctxDeadline
	}
	c.sendDeadline = c.sendDeadline && !c.overall.IsZero() // no deadline: no header to send

	// The Transport's own headers replace the caller's under every
	// spelling of their names (req.Header["request-attempt"] included):
	// each would otherwise go as a field line of its own, and the server
	// would read neither.
	own := addKey || t.cfg.attemptHeader // c.header is the Transport's map
	if t.cfg.attemptHeader {
		c.header, own = withoutSpellings(c.header, own, hop.AttemptHeader)
	}
	if c.sendDeadline {
		c.header, _ = withoutSpellings(c.header, own, deadline.Header)
	}
	if t.cfg.hedging {
		c.hedge = c.newHedging(method)
	}
	return nil
}

// withoutSpellings returns h without the fields whose names are spellings
// of name (canonical) other than name itself, copied first unless own says
// that h is the Transport's map already, and whether the result is.
func withoutSpellings(h http.Header, own bool, name string) (http.Header, bool) {
	for k := range h {
		if len(k) == len(name) && k != name && strings.EqualFold(k, name) {
			if !own {
				h, own = cloneHeader(h), true
			}
			delete(h, k)
		}
	}
	return h, own
}

// idempotentMethod reports whether method is retried as idempotent by
// default: GET, HEAD, OPTIONS, TRACE, PUT and DELETE (RFC 9110 section
// 9.2.2), compared case-sensitively as HTTP methods are.
func idempotentMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace,
		http.MethodPut, http.MethodDelete:
		return true
	}
	return false
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
