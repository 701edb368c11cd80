package idempotency

import (
	"github.com/saferetry/saferetry/keygen"

	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// Defaults of CompleterConfig.
const (
	// DefaultCompleteBatch is the most abandoned records one RunOnce takes
	// over.
	DefaultCompleteBatch = 100
	// DefaultCompleteInterval is the time between two runs of Start's loop.
	DefaultCompleteInterval = time.Minute
	// DefaultCompleteMaxBackoff is the longest a completer waits before it
	// tries again a record it failed to finish.
	DefaultCompleteMaxBackoff = time.Hour
)

// CompleterConfig configures NewCompleter. Zero fields take the defaults;
// negative ones are treated as zero.
type CompleterConfig struct {
	// Routes maps a route, as the middleware names it in Scope.Route
	// (WithRoute; by default the ServeMux pattern, such as
	// "POST /payments"), to the handler that serves it, without the
	// middleware. Records of other routes are skipped.
	Routes map[string]http.Handler
	// BatchSize is the most records one RunOnce takes over
	// (DefaultCompleteBatch).
	BatchSize int
	// Interval is the time between runs of Start's loop
	// (DefaultCompleteInterval).
	Interval time.Duration
	// MaxBackoff caps the wait before a record the completer failed to
	// finish is tried again (DefaultCompleteMaxBackoff): after its n-th
	// failure in a row a record is skipped for min(Interval*2^n,
	// MaxBackoff).
	MaxBackoff time.Duration
	// Lease is the lease of each takeover; it is heartbeated every Lease/3
	// while the handler runs (DefaultLease).
	Lease time.Duration
	// Logger receives one record per record taken over (nil:
	// slog.Default()).
	Logger *slog.Logger
	// Options are the middleware's options, so that responses are stored as
	// the middleware stores them: WithStore5xx, WithReplayHeaders,
	// WithMaxStoredBody; and WithShutdown. Options about keys, principals, methods, routes
	// and waiting do not apply. Lease and Logger above win over WithLease
	// and WithLogger.
	Options []Option
}

// CompleterReport is what one RunOnce did. Every record it listed is
// counted once, in exactly one of the fields after Found.
type CompleterReport struct {
	Found     int // abandoned records listed (lease expired, still in progress)
	Completed int // taken over and driven to a stored response
	Released  int // ran to an outcome that is not stored, with no phase committed: the key was released
	Kept      int // ran to an outcome that is not stored after a committed phase: still in progress, to resume later
	Skipped   int // not taken: no handler for the route, an unreadable stored request, backing off after failures, or someone else took it first
	Failed    int // the handler panicked, the lease was lost, or the store failed during the run
}

// Completer drives abandoned requests to completion in the background: the
// records left in progress with an expired lease by a server that crashed
// or stalled (or whose handler failed after committing a phase), when no
// client retry has come to resume them. For each it takes the record over
// with Store.Claim (a takeover bumps the fencing generation, so the old
// owner can no longer write), rebuilds the request saved at the claim
// (StoredRequest: method, URL, host, content type and body; no credentials
// or other headers) and runs the route's handler through the middleware's
// own execution path: the same Run (FromContext), phases that resume after
// the last committed one, heartbeats, and the response stored for replay, so
// a later client retry gets it with Idempotent-Replayed: true.
//
// Handlers run by the completer must take the principal from Run.Scope, not
// from the request (which carries no Authorization header). A ServeMux
// pattern route gets its path values (r.PathValue) and r.Pattern.
//
// A run whose handler fails again after a committed phase leaves the record
// in progress with its lease ended (CompleterReport.Kept): a later run, or
// a client retry, tries it again, until it completes or the Reaper deletes
// it past the cleanup horizon (and logs it). The completer backs off from a
// record it keeps failing to finish (kept, panicked, lost its lease or met
// a store failure): after n failures in a row it skips the record for
// min(Interval*2^n, MaxBackoff), so a broken downstream service is not
// called every Interval for every record. The count lives in memory, per
// Completer (a restart or another completer starts from zero), and is
// forgotten once the record completes, is released, or is no longer
// listed; a client retry is never delayed by it.
//
// Its log records name a request by method, route, key_digest and
// principal_digest (keygen.Digest: never the raw key or principal), generation,
// recovery point and creation time.
//
// A Completer is safe for concurrent use, and several completers (in
// several processes) may share one store: each record goes to one of them,
// the claim decides. Records of routes it has no handler for stay until the
// Reaper deletes them (which logs them); since Abandoned lists the oldest
// first, the completer remembers such records and lists that many more in
// later runs, so they cannot starve the others.
type Completer struct {
	store Store
	tx    Transactor
	cfg   CompleterConfig
	mcfg  config // the middleware's configuration for executions
	muxes map[string]*http.ServeMux

	now       func() time.Time
	newTicker func(d time.Duration) (<-chan time.Time, func())
	afterRun  func(CompleterReport, error) // test hook, called after each loop run

	mu          sync.Mutex
	unresumable map[Scope]int64    // records skipped for good: scope -> generation
	backoff     map[Scope]failures // records it failed to finish, waiting
}

// failures is the backoff state of a record the completer failed to finish.
type failures struct {
	n     int       // failures in a row
	until time.Time // skipped before this time
}

// NewCompleter returns a Completer over s with cfg. It starts nothing: call
// RunOnce, or Start for a background loop.
func NewCompleter(s Store, cfg CompleterConfig) *Completer {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultCompleteBatch
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultCompleteInterval
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultCompleteMaxBackoff
	}
	if cfg.Lease < 3*time.Millisecond {
		cfg.Lease = DefaultLease
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Completer{
		store: s,
		cfg:   cfg,
		mcfg:  defaultConfig(),
		muxes: make(map[string]*http.ServeMux),
		now:   time.Now,
		newTicker: func(d time.Duration) (<-chan time.Time, func()) {
			t := time.NewTicker(d)
			return t.C, t.Stop
		},
		unresumable: make(map[Scope]int64),
		backoff:     make(map[Scope]failures),
	}
	c.tx, _ = s.(Transactor)
	for _, o := range cfg.Options {
		if o != nil {
			o(&c.mcfg)
		}
	}
	c.mcfg.lease, c.mcfg.logger = cfg.Lease, cfg.Logger
	c.mcfg.now = func() time.Time { return c.now() }
	for route := range cfg.Routes {
		if mux := patternMux(route); mux != nil {
			c.muxes[route] = mux
		}
	}
	return c
}

// patternMux returns a ServeMux that has route as its only pattern and
// dispatches to the execution in the request's context, or nil when route
// is not a ServeMux pattern (a custom WithRoute name).
func patternMux(route string) (mux *http.ServeMux) {
	defer func() {
		if recover() != nil {
			mux = nil
		}
	}()
	mux = http.NewServeMux()
	mux.Handle(route, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if e, ok := r.Context().Value(execKey{}).(*execution); ok {
			e.do(w, r)
		}
	}))
	return mux
}

type execKey struct{}

// execution is one takeover that the completer runs.
type execution struct {
	h   *handler
	req request
	res ClaimResult
	ran bool
	out outcome
}

func (e *execution) do(w http.ResponseWriter, r *http.Request) {
	e.ran = true
	e.out = e.h.run(w, r, context.WithoutCancel(r.Context()), r.Context(), e.req, e.res)
}

// discardWriter is the response writer of a completer's execution: there is
// no client; the status is kept for the log.
type discardWriter struct {
	header http.Header
	status int
}

func (d *discardWriter) Header() http.Header { return d.header }
func (d *discardWriter) WriteHeader(code int) {
	if d.status == 0 {
		d.status = code
	}
}
func (d *discardWriter) Write(p []byte) (int, error) {
	d.WriteHeader(http.StatusOK)
	return len(p), nil
}

// RunOnce lists up to BatchSize abandoned records (plus as many as it
// remembers it cannot resume or is backing off from, so that those do not
// starve the others) at the current time, takes each over in turn
// and runs it to an outcome, and returns what it did. A store error at
// listing or at a claim stops the run and is returned as a *CompleterError
// with the report so far; ctx cancellation stops it between records (and
// cancels the running handler's context) with ctx's error. Failures of
// single records (a panicking handler, a lost lease, a failing store
// during the run) are logged and counted, not returned.
func (c *Completer) RunOnce(ctx context.Context) (CompleterReport, error) {
	var rep CompleterReport
	c.mu.Lock()
	extra := min(len(c.unresumable)+len(c.backoff), 10*c.cfg.BatchSize)
	c.mu.Unlock()
	recs, err := c.store.Abandoned(ctx, c.now(), c.cfg.BatchSize+extra)
	if err != nil {
		return rep, &CompleterError{Op: "abandoned", Err: err}
	}
	rep.Found = len(recs)
	listed := make(map[Scope]bool, len(recs))
	taken := 0
	for _, rec := range recs {
		listed[rec.Scope] = true
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		if taken >= c.cfg.BatchSize || c.remembered(rec) || c.waiting(rec.Scope) {
			rep.Skipped++
			continue
		}
		res, err := c.complete(ctx, rec)
		if err != nil {
			return rep, err
		}
		c.record(rec.Scope, res)
		switch res {
		case resultSkipped:
			rep.Skipped++
			continue
		case resultCompleted:
			rep.Completed++
		case resultReleased:
			rep.Released++
		case resultKept:
			rep.Kept++
		default:
			rep.Failed++
		}
		taken++
	}
	c.forget(listed)
	level := slog.LevelInfo
	if rep.Found == 0 {
		level = slog.LevelDebug
	}
	c.cfg.Logger.LogAttrs(ctx, level, "idempotency completer: run finished",
		slog.Int("found", rep.Found), slog.Int("completed", rep.Completed), slog.Int("released", rep.Released),
		slog.Int("kept", rep.Kept), slog.Int("skipped", rep.Skipped), slog.Int("failed", rep.Failed))
	return rep, nil
}

type result int

const (
	resultSkipped result = iota
	resultCompleted
	resultReleased
	resultKept
	resultFailed
)

// remembered reports whether rec was found unresumable before (at the same
// generation: a takeover by a client retry makes it worth a new look).
func (c *Completer) remembered(rec Record) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	gen, ok := c.unresumable[rec.Scope]
	return ok && gen == rec.Generation
}

func (c *Completer) remember(rec Record) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.unresumable[rec.Scope] = rec.Generation
}

// forget drops remembered records that are no longer abandoned.
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

// waiting reports whether the completer is backing off from the record of s.
func (c *Completer) waiting(s Scope) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	f, ok := c.backoff[s]
	return ok && c.now().Before(f.until)
}

// record updates the backoff of the record of s after an attempt: a failure
// (kept or failed) doubles its wait, anything else ends it.
func (c *Completer) record(s Scope, res result) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch res {
	case resultKept, resultFailed:
		f := c.backoff[s]
		f.n++
		wait := c.cfg.MaxBackoff
		if f.n < 62 && c.cfg.Interval <= c.cfg.MaxBackoff>>f.n {
			wait = c.cfg.Interval << f.n
		}
		f.until = c.now().Add(wait)
		c.backoff[s] = f
	case resultSkipped:
		// not attempted: nothing learned
	default:
		delete(c.backoff, s)
	}
}

func (c *Completer) log(ctx context.Context, level slog.Level, msg string, rec Record, attrs ...slog.Attr) {
	attrs = append([]slog.Attr{
		slog.String("method", rec.Scope.Method), slog.String("route", rec.Scope.Route),
		slog.String("key_digest", keygen.Digest(rec.Scope.Key)), slog.String("principal_digest", keygen.Digest(rec.Scope.Principal)),
		slog.Int64("generation", rec.Generation), slog.String("recovery_point", rec.RecoveryPoint),
		slog.Time("created_at", rec.CreatedAt),
	}, attrs...)
	c.cfg.Logger.LogAttrs(ctx, level, msg, attrs...)
}

// complete takes rec over and runs it. Only a store error at the claim is
// returned.
func (c *Completer) complete(ctx context.Context, rec Record) (result, error) {
	next, ok := c.cfg.Routes[rec.Scope.Route]
	if !ok || next == nil {
		c.remember(rec)
		c.log(ctx, slog.LevelWarn, "idempotency completer: no handler for the route of an abandoned request; skipped", rec)
		return resultSkipped, nil
	}
	sr, err := DecodeRequest(rec.Request)
	if err == nil && sr.Method == "" {
		err = errors.New("no method")
	}
	if err != nil {
		c.remember(rec)
		c.log(ctx, slog.LevelWarn, "idempotency completer: the stored request of an abandoned request is unreadable; skipped", rec,
			slog.String("error", err.Error()))
		return resultSkipped, nil
	}
	h := &handler{cfg: c.mcfg, store: c.store, tx: c.tx, next: next}
	// A takeover only: a completed record is never restarted and a record
	// that vanished is not recreated.
	res, err := c.store.Claim(ctx, Claim{
		Scope: rec.Scope, Fingerprint: rec.Fingerprint, FingerprintVersion: rec.FingerprintVersion,
		Owner: c.mcfg.newOwner(), Now: c.now(), LeaseFor: c.cfg.Lease, TakeoverOnly: true,
	})
	if err != nil {
		return resultSkipped, &CompleterError{Op: "claim", Scope: rec.Scope, Err: err}
	}
	if res.Outcome != ClaimTakenOver {
		return resultSkipped, nil // resumed, completed or taken by someone else meanwhile
	}
	got := res.Record
	c.log(ctx, slog.LevelInfo, "idempotency completer: took over an abandoned request", got)

	r, err := http.NewRequestWithContext(ctx, sr.Method, sr.URL, bytes.NewReader(sr.Body))
	if err != nil {
		c.log(ctx, slog.LevelWarn, "idempotency completer: the stored request cannot be rebuilt", got, slog.String("error", err.Error()))
		h.abort(context.WithoutCancel(ctx), got.Lease(), got.RecoveryPoint)
		return resultFailed, nil
	}
	r.Host, r.RequestURI, r.RemoteAddr = sr.Host, sr.URL, ""
	if sr.ContentType != "" {
		r.Header.Set("Content-Type", sr.ContentType)
	}
	e := &execution{h: h, req: request{scope: got.Scope, fp: got.Fingerprint, body: sr.Body}, res: res}
	w := &discardWriter{header: make(http.Header)}
	out, panicked := c.execute(e, r, w)
	attrs := []slog.Attr{slog.Int("status", w.status)}
	switch {
	case panicked:
		c.log(ctx, slog.LevelError, "idempotency completer: the handler panicked; the record was given up or kept for a resume", got, attrs...)
		return resultFailed, nil
	case out == outcomeCompleted:
		c.log(ctx, slog.LevelInfo, "idempotency completer: completed an abandoned request", got, attrs...)
		return resultCompleted, nil
	case out == outcomeReleased:
		c.log(ctx, slog.LevelWarn, "idempotency completer: the resumed request failed before any phase; the key was released", got, attrs...)
		return resultReleased, nil
	case out == outcomeKept:
		c.log(ctx, slog.LevelWarn, "idempotency completer: the resumed request failed after a committed phase; it stays in progress", got, attrs...)
		return resultKept, nil
	default:
		c.log(ctx, slog.LevelWarn, "idempotency completer: the resumed request lost its lease or met a store failure", got, attrs...)
		return resultFailed, nil
	}
}

// execute runs e on r, through the route's pattern mux when there is one
// (for r.Pattern and path values), and recovers a panic of the handler
// (the execution path has already given up or kept the record).
func (c *Completer) execute(e *execution, r *http.Request, w *discardWriter) (out outcome, panicked bool) {
	defer func() {
		if p := recover(); p != nil {
			panicked = true
		}
	}()
	if mux := c.muxes[e.req.scope.Route]; mux != nil {
		mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), execKey{}, e)))
	}
	if !e.ran {
		// Not a pattern, or the stored request does not match it (the mux
		// answered itself): run the handler directly.
		*w = discardWriter{header: make(http.Header)}
		r.Pattern = e.req.scope.Route
		e.do(w, r)
	}
	return e.out, false
}

// Start runs RunOnce in a background goroutine: once immediately, then every
// Interval, until ctx is done or stop is called. Errors are logged at Error
// and the loop goes on. stop cancels the loop (a handler running then sees
// its context canceled) and waits for the goroutine to return; it is safe
// to call more than once and from several goroutines.
func (c *Completer) Start(ctx context.Context) (stop func()) {
	return runEvery(ctx, c.newTicker, c.cfg.Interval, func(ctx context.Context) {
		rep, err := c.RunOnce(ctx)
		if err != nil && ctx.Err() == nil {
			c.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idempotency completer: run failed",
				slog.String("error", err.Error()), slog.Int("completed", rep.Completed))
		}
		if c.afterRun != nil {
			c.afterRun(rep, err)
		}
	})
}

// ErrCompleter is matched (errors.Is) by every *CompleterError.
var ErrCompleter = errors.New("idempotency: completer failed")

// CompleterError reports the store call that stopped a RunOnce
// ("abandoned" or "claim"; Scope is set for a claim). It matches
// ErrCompleter and, through Unwrap, the store's own error.
type CompleterError struct {
	Op    string
	Scope Scope
	Err   error
}

// Error returns "idempotency: completer: <op>: <cause>".
func (e *CompleterError) Error() string {
	return "idempotency: completer: " + e.Op + ": " + e.Err.Error()
}

// Unwrap returns ErrCompleter and the store's error.
func (e *CompleterError) Unwrap() []error { return []error{ErrCompleter, e.Err} }
