package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Defaults of the middleware options.
const (
	// DefaultLease is the lease a claim holds (WithLease).
	DefaultLease = 30 * time.Second
	// DefaultReplayWindow is how long a completed response is replayed
	// (WithReplayWindow).
	DefaultReplayWindow = 24 * time.Hour
	// DefaultMaxRequestBody is the largest request body read (1 MiB,
	// WithMaxRequestBody).
	DefaultMaxRequestBody = 1 << 20
	// DefaultMaxStoredBody is the largest response body stored (1 MiB,
	// WithMaxStoredBody).
	DefaultMaxStoredBody = 1 << 20
	// DefaultMismatchStatus is the status of a CodeKeyReused answer
	// (WithMismatchStatus).
	DefaultMismatchStatus = http.StatusUnprocessableEntity
)

// DefaultReplayHeaders is the default allow-list of response headers that
// are stored and replayed (WithReplayHeaders replaces it).
var DefaultReplayHeaders = []string{
	"Content-Type", "Content-Language", "Content-Encoding", "Content-Disposition",
	"Content-Location", "Location", "Cache-Control", "ETag", "Last-Modified",
	"Expires", "Link", "Vary",
}

// neverReplayed lists headers that are never stored or replayed even when
// WithReplayHeaders names them: cookies, per-exchange values and framing.
var neverReplayed = map[string]bool{
	"Set-Cookie": true, "Set-Cookie2": true, "Date": true, "Age": true,
	"X-Request-Id": true, "X-Correlation-Id": true, "Request-Id": true,
	"Traceparent": true, "Tracestate": true, "Server-Timing": true,
	"Content-Length": true, "Transfer-Encoding": true, "Connection": true,
	"Keep-Alive": true, "Trailer": true, "Upgrade": true, "Proxy-Connection": true,
	"Idempotent-Replayed": true, notReplayableHeader: true,
}

// Option configures New. Options are applied in order; a later one wins.
type Option func(*config)

type config struct {
	principal      func(*http.Request) (string, error)
	anonymous      bool
	methods        map[string]bool
	required       bool
	mismatchStatus int
	wait           time.Duration
	lease          time.Duration
	replayWindow   time.Duration
	replayHeaders  map[string]bool
	maxRequestBody int64
	maxStoredBody  int
	store5xx       bool
	route          func(*http.Request) string
	header         string
	logger         *slog.Logger
	obs            Observer
	shutdown       context.Context

	// test hooks
	now          func() time.Time
	sleep        func(ctx context.Context, d time.Duration) error
	pollInterval time.Duration
	newOwner     func() string // a fresh owner token (Claim.Owner)
}

// AuthorizationPrincipal is the default principal function: "authz:" and the
// hex SHA-256 of the request's Authorization header (all field lines joined
// by newlines), or "" when the header is absent. It never fails.
//
// It is a stand-in, not authentication: the middleware does not verify the
// credential. A request without an Authorization header has no principal,
// so by default its key is refused (401 CodePrincipalMissing; see
// WithAnonymousKeys). Its other risks: anyone can invent a header value and
// get a scope of their own, so it isolates nothing from a caller who holds
// or guesses the same header; and a caller whose token rotates becomes a
// new principal, so a retry sent with a refreshed token runs again.
// Production servers should pass WithPrincipal a function returning the
// account their authentication verified.
func AuthorizationPrincipal(r *http.Request) (string, error) {
	vals := r.Header.Values("Authorization")
	if len(vals) == 0 {
		return "", nil
	}
	sum := sha256.Sum256([]byte(strings.Join(vals, "\n")))
	return "authz:" + hex.EncodeToString(sum[:]), nil
}

// DefaultRoute is the default route function: r.Pattern (set by
// http.ServeMux when it routed the request to the guarded handler), or
// r.URL.Path when the pattern is empty (the middleware wraps a mux, or
// another router is used).
func DefaultRoute(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.URL.Path
}

func defaultConfig() config {
	c := config{
		principal:      AuthorizationPrincipal,
		methods:        map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		mismatchStatus: DefaultMismatchStatus,
		lease:          DefaultLease,
		replayWindow:   DefaultReplayWindow,
		maxRequestBody: DefaultMaxRequestBody,
		maxStoredBody:  DefaultMaxStoredBody,
		route:          DefaultRoute,
		header:         DefaultKeyHeader,
		logger:         slog.Default(),
		now:            time.Now,
		sleep:          sleepCtx,
		pollInterval:   100 * time.Millisecond,
		newOwner:       uuid.NewString,
	}
	c.replayHeaders = headerSet(DefaultReplayHeaders)
	return c
}

func headerSet(names []string) map[string]bool {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		if n = http.CanonicalHeaderKey(strings.TrimSpace(n)); n != "" && !neverReplayed[n] {
			m[n] = true
		}
	}
	return m
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// WithPrincipal sets the function that returns the authenticated identity of
// a request; it is the first part of every record's scope, so one principal
// never sees another's stored response. It must return what the server's
// authentication verified (an account ID), never a value the client can set
// freely (an unverified header): scopes are only as separate as principals
// are authentic. When f returns an error the middleware answers 401
// CodePrincipalUnavailable and the handler does not run; when it returns ""
// (no principal), 401 CodePrincipalMissing unless WithAnonymousKeys is set.
// nil keeps the default. f must be safe for concurrent use.
//
// Default: AuthorizationPrincipal, under which a request without an
// Authorization header has no principal.
func WithPrincipal(f func(*http.Request) (string, error)) Option {
	return func(c *config) {
		if f != nil {
			c.principal = f
		}
	}
}

// WithAnonymousKeys lets guarded requests that have no principal (the
// principal function returns ""; by default, requests without an
// Authorization header) use idempotency keys, all in one scope: the
// principal "". Default off: such a request gets 401 CodePrincipalMissing
// and the handler does not run (requests without a key are not guarded and
// still pass through).
//
// The risk, which is why it is off by default: every anonymous caller
// shares one namespace of keys. An anonymous caller who sends the key of
// another, by chance or on purpose (event-derived keys such as
// keygen.Event("order-confirm", orderID) are guessable), receives that
// caller's stored response, whatever it holds, or holds up or spoils the
// other's request (409 CodeInProgress, CodeKeyReused). Use it only where
// the stored responses reveal nothing about their caller and clients use
// unguessable (random) keys.
func WithAnonymousKeys() Option {
	return func(c *config) { c.anonymous = true }
}

// WithMethods sets the guarded methods (case-insensitive). Requests with
// other methods pass through untouched. Default: POST and PATCH. An empty
// list keeps the default.
func WithMethods(methods ...string) Option {
	return func(c *config) {
		if len(methods) == 0 {
			return
		}
		c.methods = make(map[string]bool, len(methods))
		for _, m := range methods {
			c.methods[strings.ToUpper(m)] = true
		}
	}
}

// WithKeyRequired makes a key mandatory on guarded methods: a request
// without one gets 400 CodeKeyMissing. Default false: such requests pass
// through to the handler unprotected.
func WithKeyRequired(required bool) Option {
	return func(c *config) { c.required = required }
}

// WithMismatchStatus sets the status of a CodeKeyReused answer: 422
// (default) or 409. Other values keep the default.
func WithMismatchStatus(status int) Option {
	return func(c *config) {
		if status == http.StatusConflict || status == http.StatusUnprocessableEntity {
			c.mismatchStatus = status
		}
	}
}

// WithInProgressWait sets how long a request whose key is in progress waits
// (polling the store) for the first one to finish before it gets 409
// CodeInProgress. The wait never outlasts the request's context. Default 0:
// answer at once. Negative values mean 0.
func WithInProgressWait(d time.Duration) Option {
	return func(c *config) { c.wait = max(d, 0) }
}

// WithLease sets the lease a claim holds. The middleware heartbeats every
// lease/3 while the handler runs; a lease that expires anyway (a stalled
// process) lets a retry take the record over, and the old owner's writes are
// then rejected (ErrLeaseLost). When heartbeats keep failing (the store
// unreachable) until less than lease/3 is left, the handler's context is
// canceled with cause ErrLeaseExpired (its work is still completed, fenced,
// when it returns). Set
// the lease well above the store's worst latency. Default 30 s; values under
// 3 ms keep the default.
func WithLease(d time.Duration) Option {
	return func(c *config) {
		if d >= 3*time.Millisecond {
			c.lease = d
		}
	}
}

// WithReplayWindow sets how long a completed response is replayed; after it
// a reused key is a new request. Set it above the longest retry chain
// (dead-letter replays, scheduled re-runs). Default 24 h; values <= 0 keep
// the default.
//
// The Reaper must keep records at least that long: give its
// ReaperConfig.ReplayWindow the same value. It never deletes a record
// sooner than ReplayWindow + Lease after its last update (a shorter Horizon,
// such as DefaultCleanupHorizon under a 7-day window, is raised to that and
// logged at Warn); a Reaper that is not told the window assumes
// DefaultReplayWindow and would delete records a longer window still
// replays, so a retry would run again.
func WithReplayWindow(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.replayWindow = d
		}
	}
}

// WithReplayHeaders replaces the allow-list of response headers that are
// stored and replayed (default DefaultReplayHeaders). Set-Cookie, Date,
// per-exchange ids (X-Request-Id, Traceparent, ...) and framing headers are
// never stored even when listed. The first response goes to its client with
// all its headers; only replays are filtered.
func WithReplayHeaders(names ...string) Option {
	return func(c *config) { c.replayHeaders = headerSet(names) }
}

// WithMaxRequestBody sets the largest request body the middleware reads
// (and fingerprints) on a guarded request with a key; a larger one gets 413
// CodeRequestTooLarge and the handler does not run. Below the limit the
// handler gets the full body. Default 1 MiB; values <= 0 keep the default.
func WithMaxRequestBody(n int64) Option {
	return func(c *config) {
		if n > 0 {
			c.maxRequestBody = n
		}
	}
}

// WithMaxStoredBody sets the largest response body stored for replay.
// Default 1 MiB; values <= 0 keep the default. A larger response still goes
// to its first client in full (it is buffered in memory until the record
// commits), and the record still completes, so the work is never done again
// for that key; but the body is not stored, and every replay answers 409
// CodeResponseNotReplayable with the original status in "original_status".
func WithMaxStoredBody(n int) Option {
	return func(c *config) {
		if n > 0 {
			c.maxStoredBody = n
		}
	}
}

// WithStore5xx stores 5xx responses and replays them like any other
// (Stripe API v1 behaviour). Default false: a 5xx releases the key so that a
// retry runs again (unless a recovery point was committed). Panics always
// release.
func WithStore5xx(store bool) Option {
	return func(c *config) { c.store5xx = store }
}

// WithRoute sets the function that names the route of a request for its
// scope and fingerprint. Default DefaultRoute. nil keeps the default.
func WithRoute(f func(*http.Request) string) Option {
	return func(c *config) {
		if f != nil {
			c.route = f
		}
	}
}

// WithKeyHeader sets the request header that carries the key. Default
// DefaultKeyHeader ("Idempotency-Key"). "" keeps the default.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		if name != "" {
			c.header = http.CanonicalHeaderKey(name)
		}
	}
}

// WithShutdown sets the context whose end stops the handlers of claimed
// requests when the server shuts down: their contexts are canceled with
// context.Cause(ctx). Once a key is claimed, the handler's context is not
// canceled when the client goes away (the work runs to its end and its
// response is stored for the client's retry); it ends only when its lease
// is lost, its deadline passes, or ctx ends. Pass the context you cancel to
// shut down, the one you give http.Server.BaseContext, for example: the
// middleware cannot see BaseContext's cancellation through a request whose
// client-side cancellation it drops. What a handler stopped this way
// answers is handled as any answer (a 5xx releases the key, or keeps it for
// a resume after a committed phase). Default none: handlers run to their end
// or their deadline, which http.Server.Shutdown waits for. nil keeps the
// default. It applies to the Completer's executions too when given among its
// options.
func WithShutdown(ctx context.Context) Option {
	return func(c *config) {
		if ctx != nil {
			c.shutdown = ctx
		}
	}
}

// WithLogger sets the logger for store failures, lost leases and releases.
// Default slog.Default(). nil keeps the default.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) {
		if l != nil {
			c.logger = l
		}
	}
}
