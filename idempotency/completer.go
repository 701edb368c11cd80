package idempotency

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// Completer drives abandoned requests and calls to completion in the
// background: the records left in progress with an expired lease by a
// server or job that crashed or stalled, or whose work failed after
// committing a phase, when no client retry or later call came to resume
// them. It takes each over (Claim with TakeoverOnly, so the old owner is
// fenced off) and runs it through the core's own execution: phases resume
// after the last committed one, and the response or output is stored for
// the retry to replay. A request is rebuilt from what was saved at the
// claim (method, URL, host, content type and body: no credentials) and
// served by its route's handler; a call of Do is run by the function
// registered for its Operation, which finds the call's payload in
// Run.Payload. Handlers and functions take the principal from Run.Scope
// (FromContext), live and on resume alike, never from the request's
// headers. A 401 or 403 that a
// resumed handler answers (it, or an auth layer in front of it, looked for
// credentials) is never stored: the record is kept, its lease ended, for
// the client's retry to take over with its credentials
// (OutcomeNeedsCredentials, logged at Warn).
//
// It backs off from a record it fails to finish (kept, refused for want of
// credentials, panicked, lost its lease, met a store failure): after n
// failures in a row it skips the record for min(2^n minutes, 1 hour),
// counted in memory per Completer. A record whose route or operation has
// nothing registered, or whose request cannot be rebuilt, is reported once
// ("unresumable") and left for the Reaper. Several Completers, in several
// processes, may share a store: the claim decides who runs a record. A
// Completer is safe for concurrent use.
type Completer struct {
	m         *Middleware
	routes    map[string]http.Handler
	muxes     map[string]*http.ServeMux
	functions map[string]func(ctx context.Context, run *Run) ([]byte, error)

	mu          sync.Mutex
	unresumable map[Scope]int64    // records skipped for good: scope -> generation
	backoff     map[Scope]failures // records it failed to finish, waiting
}

// Function names the function that resumes the records of the calls of Do
// with Operation: the fn those calls were given, or one that does the same
// work (Completer).
type Function struct {
	Operation string
	Fn        func(ctx context.Context, run *Run) ([]byte, error)
}

// failures is the backoff state of a record the Completer failed to finish.
type failures struct {
	n     int       // failures in a row
	until time.Time // skipped before this time
}

const (
	completeBatch      = 100 // records taken over per run
	completeMinBackoff = time.Minute
	completeMaxBackoff = time.Hour
)

// Completer returns a Completer for m's store and policy. routes maps a
// route, as the middleware names it in Scope.Route (a ServeMux pattern such
// as "POST /payments" by default), to the handler that serves it, without
// the middleware. A middleware mounted on a subtree over a router that is
// not an *http.ServeMux names routes by the raw request path, which routes
// cannot list (every such record is unresumable): give it WithRoute.
// functions name the functions that resume the calls of Do, by Operation
// (a later one for the same Operation wins; a nil Fn names none). It
// starts nothing: call RunOnce, or Start.
func (m *Middleware) Completer(routes map[string]http.Handler, functions ...Function) *Completer {
	c := &Completer{
		m: m, routes: routes, muxes: make(map[string]*http.ServeMux),
		functions:   make(map[string]func(ctx context.Context, run *Run) ([]byte, error)),
		unresumable: make(map[Scope]int64), backoff: make(map[Scope]failures),
	}
	for route := range routes {
		if mux := patternMux(route); mux != nil {
			c.muxes[route] = mux
		}
	}
	for _, f := range functions {
		if f.Fn == nil {
			delete(c.functions, f.Operation)
			continue
		}
		c.functions[f.Operation] = f.Fn
	}
	return c
}

// CompleterReport is what one Completer run did. Every record it listed is
// counted once, in exactly one of the fields after Found.
type CompleterReport struct {
	// Found counts the abandoned records listed (lease expired, still in
	// progress).
	Found int
	// Completed: taken over and driven to a stored response.
	Completed int
	// Released: ran to an answer that is not stored, with no phase
	// committed; the key was released.
	Released int
	// Kept: ran to an answer that is not stored after a committed phase;
	// kept for a resume.
	Kept int
	// NeedCredentials: the handler answered 401 or 403; not resumable
	// without credentials, kept for the client's retry.
	NeedCredentials int
	// Skipped: not run (unresumable, backing off, over the batch, or taken
	// by someone else first).
	Skipped int
	// Failed: the handler panicked, the lease was lost, or the store failed
	// during the run.
	Failed int
}

// RunOnce lists the abandoned records (up to 100 to take over, plus those it
// remembers it cannot resume or is backing off from, so that they do not
// starve the others), takes each over in turn, runs it to an outcome, and
// returns what it did. It yields to live traffic: after each record it
// waits as long as that record took (at most a minute) before the next. A
// store error at the listing or at a claim stops the run and is returned,
// wrapped, with the report so far; ctx's end stops it between records (and
// cancels the running handler's context). Failures of single records are
// reported to the observers and counted, not returned.
// Without a store (New(nil)) every run fails.
func (c *Completer) RunOnce(ctx context.Context) (CompleterReport, error) {
	rep, err := c.runOnce(ctx)
	c.m.obs.completerRun(ctx, rep, err)
	return rep, err
}

func (c *Completer) runOnce(ctx context.Context) (CompleterReport, error) {
	var rep CompleterReport
	if err := c.m.sweeps(); err != nil {
		return rep, fmt.Errorf("idempotency: completer: %w", err)
	}
	c.mu.Lock()
	extra := min(len(c.unresumable)+len(c.backoff), 10*completeBatch)
	c.mu.Unlock()
	recs, err := c.m.g.abandoned(ctx, time.Now(), completeBatch+extra)
	if err != nil {
		return rep, fmt.Errorf("idempotency: completer: listing abandoned records: %w", err)
	}
	rep.Found = len(recs)
	listed := make(map[Scope]bool, len(recs))
	taken := 0
	for _, rec := range recs {
		listed[rec.Scope] = true
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		if taken >= completeBatch || c.remembered(rec) || c.waiting(rec.Scope) {
			rep.Skipped++
			continue
		}
		start := time.Now()
		outcome, err := c.resume(ctx, rec)
		if err != nil {
			return rep, err
		}
		_ = yield(ctx, time.Since(start)) // ctx's end stops the loop at its top
		c.record(rec.Scope, outcome)
		switch outcome {
		case "", OutcomeUnresumable:
			rep.Skipped++
			continue
		case OutcomeCompleted:
			rep.Completed++
		case OutcomeReleased:
			rep.Released++
		case OutcomeKept, OutcomeIncomplete:
			rep.Kept++
		case OutcomeNeedsCredentials:
			rep.NeedCredentials++
		default:
			rep.Failed++
		}
		taken++
	}
	c.forget(listed)
	return rep, nil
}

// remembered reports whether rec was found unresumable before, at the same
// generation (a client retry's takeover makes it worth a new look).
func (c *Completer) remembered(rec Record) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	gen, ok := c.unresumable[rec.Scope]
	return ok && gen == rec.Generation
}

// forget drops the records it remembers that are no longer abandoned.
func (c *Completer) forget(listed map[Scope]bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for s := range c.unresumable {
		if !listed[s] {
			delete(c.unresumable, s)
		}
	}
	for s := range c.backoff {
		if !listed[s] {
			delete(c.backoff, s)
		}
	}
}

// waiting reports whether the Completer is backing off from s's record.
func (c *Completer) waiting(s Scope) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	f, ok := c.backoff[s]
	return ok && time.Now().Before(f.until)
}

// record updates the backoff of s's record after an attempt: a failure
// doubles its wait, a settled record ends it.
func (c *Completer) record(s Scope, outcome Outcome) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch outcome {
	case "", OutcomeUnresumable:
		// not run: nothing learned
	case OutcomeCompleted, OutcomeReleased:
		delete(c.backoff, s)
	default:
		f := c.backoff[s]
		f.n++
		wait := completeMaxBackoff
		if f.n < 62 && completeMinBackoff <= completeMaxBackoff>>f.n {
			wait = completeMinBackoff << f.n
		}
		f.until = time.Now().Add(wait)
		c.backoff[s] = f
	}
}

// resume takes rec over and runs it, and returns the outcome (see
// Observer.Executed; "" when it did not take it). Only a store error at the
// claim is returned.
func (c *Completer) resume(ctx context.Context, rec Record) (Outcome, error) {
	run, err := c.resumption(ctx, rec)
	if err != nil {
		c.mu.Lock()
		c.unresumable[rec.Scope] = rec.Generation
		c.mu.Unlock()
		c.m.obs.executed(ctx, Event{Scope: rec.Scope, Outcome: OutcomeUnresumable,
			Generation: rec.Generation, RecoveryPoint: rec.RecoveryPoint, Err: err,
			Background: true})
		return OutcomeUnresumable, nil
	}
	// A takeover only: a completed record is never restarted and one that
	// vanished is not recreated.
	res, err := c.m.g.claim(ctx, Claim{
		Scope: rec.Scope, Fingerprint: rec.Fingerprint, FingerprintVersion: rec.FingerprintVersion,
		Owner: rand.Text(), Now: time.Now(), LeaseFor: c.m.cfg.lease, TakeoverOnly: true,
	})
	if err != nil {
		return "", fmt.Errorf("idempotency: completer: claim: %w", err)
	}
	if res.Outcome != ClaimTakenOver {
		return "", nil // resumed, completed or taken by someone else meanwhile
	}
	return run(res), nil
}

// resumption returns what runs rec once taken over, or says why it cannot
// be resumed: a call of Do through its operation's function, a request
// through its route's handler.
func (c *Completer) resumption(ctx context.Context, rec Record) (func(ClaimResult) Outcome,
	error) {
	sr, err := decodeRequest(rec.Request)
	if err != nil {
		return nil, err
	}
	s := rec.Scope
	if s.Method == "" { // a call of Do: Scope.Route is its Operation
		fn := c.functions[s.Route]
		if fn == nil {
			return nil, errors.New("no function for the record's operation")
		}
		req := newRequest(ctx, s, fingerprintInput{route: s.Route, body: sr.Body}, sr)
		return func(res ClaimResult) Outcome {
			_, outcome, _ := c.m.perform(req, res, true, fn)
			return outcome
		}, nil
	}
	r, err := c.rebuild(ctx, rec, sr)
	if err != nil {
		return nil, err
	}
	req := newRequest(ctx, s, fingerprintInput{
		method: s.Method, route: s.Route, path: r.URL.EscapedPath(), rawQuery: r.URL.RawQuery,
		contentType: sr.ContentType, body: sr.Body,
	}, sr)
	return func(res ClaimResult) Outcome {
		e := &resumption{h: &handler{m: c.m, next: c.routes[s.Route]}, req: req, res: res}
		return c.execute(e, r)
	}, nil
}

// rebuild rebuilds the request sr stored in rec, or says why it cannot.
func (c *Completer) rebuild(ctx context.Context, rec Record, sr storedRequest) (*http.Request,
	error) {
	if c.routes[rec.Scope.Route] == nil {
		return nil, errors.New("no handler for the record's route")
	}
	// The URL is a request URI, read as net/http's server reads it: a path
	// that starts with "//" names no host.
	u, err := url.ParseRequestURI(sr.URL)
	if err != nil {
		return nil, err
	}
	r, err := http.NewRequestWithContext(ctx, rec.Scope.Method, "/", bytes.NewReader(sr.Body))
	if err != nil {
		return nil, err
	}
	r.URL, r.Host, r.RequestURI, r.RemoteAddr = u, sr.Host, sr.URL, ""
	if sr.ContentType != "" {
		r.Header.Set("Content-Type", sr.ContentType)
	}
	return r, nil
}

// patternMux returns a ServeMux that has route as its only pattern and runs
// the resumption in the request's context, or nil when route is not a
// ServeMux pattern (a WithRoute name): the handler then gets r.Pattern and
// its path values as on the first execution.
func patternMux(route string) (mux *http.ServeMux) {
	defer func() {
		if recover() != nil {
			mux = nil
		}
	}()
	mux = http.NewServeMux()
	mux.Handle(route, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if e, ok := r.Context().Value(resumptionKey{}).(*resumption); ok {
			e.do(w, r)
		}
	}))
	return mux
}

type resumptionKey struct{}

// resumption is one takeover that the Completer runs.
type resumption struct {
	h       *handler
	req     request
	res     ClaimResult
	ran     bool
	outcome Outcome
}

func (e *resumption) do(w http.ResponseWriter, r *http.Request) {
	e.ran = true
	e.outcome = e.h.run(w, r, e.req, e.res, true)
}

// discardWriter is the response writer of a resumption: it has no client.
type discardWriter struct{ header http.Header }

func (d *discardWriter) Header() http.Header         { return d.header }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }

// execute runs e on r, through the route's pattern mux when there is one,
// and recovers a panic of the handler, whose record the execution has
// already given up or kept.
func (c *Completer) execute(e *resumption, r *http.Request) (outcome Outcome) {
	defer func() {
		if p := recover(); p != nil {
			outcome = OutcomePanicked
		}
	}()
	if mux := c.muxes[e.req.scope.Route]; mux != nil {
		rctx := context.WithValue(r.Context(), resumptionKey{}, e)
		mux.ServeHTTP(&discardWriter{header: make(http.Header)}, r.WithContext(rctx))
	}
	if !e.ran {
		// Not a pattern, or the stored request does not match it (the mux
		// answered itself): run the handler directly.
		r.Pattern = e.req.scope.Route
		e.do(&discardWriter{header: make(http.Header)}, r)
	}
	return e.outcome
}

// Start runs RunOnce in a background goroutine, at once and then interval
// after each run (default and <= 0: one minute), until ctx ends or stop is
// called. stop cancels the loop (a running handler sees its context
// canceled) and waits for the goroutine; it is safe to call more than once.
func (c *Completer) Start(ctx context.Context, interval time.Duration) (stop func()) {
	if interval <= 0 {
		interval = time.Minute
	}
	return every(ctx, func(ctx context.Context) time.Duration {
		_, _ = c.RunOnce(ctx)
		return interval
	})
}
