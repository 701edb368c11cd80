package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
)

// The policy's defaults: WithReplayWindow, WithLease, WithCleanupHorizon.
const (
	defaultReplayWindow   = 24 * time.Hour
	defaultLease          = 30 * time.Second
	defaultCleanupHorizon = 72 * time.Hour
)

// addSat returns a + b, saturating at the bounds of time.Duration: every
// sum of configured durations goes through it, so that "forever"
// (math.MaxInt64) plus a lease is still forever, not a negative duration.
func addSat(a, b time.Duration) time.Duration {
	s := a + b
	switch {
	case b > 0 && s < a:
		return math.MaxInt64
	case b < 0 && s > a:
		return math.MinInt64
	}
	return s
}

// minLease is the shortest lease (WithLease): its heartbeat, every third
// of it, is then 1 ms apart.
const minLease = 3 * time.Millisecond

// replayHeaders is the default allow-list of response headers that are
// stored and replayed (WithReplayHeaders adds to it).
var replayHeaders = []string{
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
	ReplayedHeader: true, notReplayableHeader: true,
}

// ErrPrincipalRefused is what a principal function (WithPrincipal) returns,
// wrapped or bare, to refuse a request's credentials: the middleware
// answers 401 CodePrincipalRefused. Any other error of the function means
// the caller could not be identified for now (503).
var ErrPrincipalRefused = errors.New("idempotency: credentials refused")

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
	horizon        time.Duration
	replayHeaders  map[string]bool
	maxRequestBody int64
	maxStoredBody  int64
	store5xx       bool
	route          func(*http.Request) string // nil: the default route
	header         string
	logger         *slog.Logger // nil: no logging
	observers      []Observer
	shutdown       context.Context
	monitorPath    string        // WithMonitor's path, ending in "/"; "" for none
	monitorIDs     *ids          // nil: no identifiers (no 202, no Location)
	monitorErr     error         // why WithMonitor's values were refused
	acceptAfter    time.Duration // WithAcceptAfter; 0: never
	oneTx          bool          // WithOneTransaction
}

func defaultConfig() config {
	return config{
		principal:      authorizationPrincipal,
		methods:        map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		mismatchStatus: http.StatusUnprocessableEntity,
		lease:          defaultLease,
		replayWindow:   defaultReplayWindow,
		horizon:        defaultCleanupHorizon,
		replayHeaders:  headerSet(replayHeaders),
		maxRequestBody: 1 << 20,
		maxStoredBody:  1 << 20,
		header:         "Idempotency-Key",
		logger:         slog.Default(),
	}
}

// authorizationPrincipal is the default principal: "authz:" and the hex
// SHA-256 of the request's Authorization field lines joined by newlines, or
// "" (no principal) when no line carries a credential.
func authorizationPrincipal(r *http.Request) (string, error) {
	vals := r.Header.Values("Authorization")
	if !slices.ContainsFunc(vals, hasCredential) {
		return "", nil
	}
	sum := sha256.Sum256([]byte(strings.Join(vals, "\n")))
	return "authz:" + hex.EncodeToString(sum[:]), nil
}

// authSchemes are the authentication schemes of the IANA registry, and a
// few common unregistered ones, lower-cased: an Authorization value that
// is one of them alone carries no credential.
var authSchemes = map[string]bool{
	"basic": true, "bearer": true, "concealed": true, "digest": true, "dpop": true, "gnap": true,
	"hoba": true, "mutual": true, "negotiate": true, "ntlm": true, "oauth": true,
	"privatetoken": true, "scram-sha-1": true, "scram-sha-256": true, "vapid": true, "token": true,
	"apikey": true, "aws4-hmac-sha256": true,
}

// hasCredential reports whether an Authorization value carries a
// credential: it is neither blank nor an authentication scheme alone.
func hasCredential(v string) bool {
	v = strings.TrimSpace(v)
	return v != "" && !authSchemes[strings.ToLower(v)]
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

// WithPrincipal sets the function that returns the authenticated identity of
// a request, the first part of every key's scope: one principal never sees
// another's stored response. Return what the server's authentication
// verified (an account ID), never a value the client sets freely; handlers
// read it back from Run.Scope.Principal (FromContext), live and on a
// resume. An error wrapping ErrPrincipalRefused (credentials that are
// wrong, expired or revoked) is answered 401 CodePrincipalRefused, which a
// client does not retry; any other error (the authentication backend is
// unreachable) is a server failure, answered 503 CodePrincipalUnavailable
// with Retry-After: 1, which a client retries with the same key; nothing
// runs either way, and a panic of f goes on to net/http as a handler's
// would, before anything is claimed. "" means no principal (see
// WithAnonymousKeys). f must be safe for concurrent use; nil keeps the
// default.
//
// Default: the SHA-256 of the Authorization header, which is no
// authentication (anyone holding the same header shares the scope, and a
// rotated token is a new principal); a header without a credential (absent,
// blank, or a scheme alone such as "Bearer") is no principal.
func WithPrincipal(f func(*http.Request) (string, error)) Option {
	return func(c *config) {
		if f != nil {
			c.principal = f
		}
	}
}

// WithAnonymousKeys lets requests (and calls of Do) without a principal use
// keys, all in one shared scope. Default false: such a request gets 401
// CodePrincipalMissing, such a call ErrInvalidCall. Enable it only where stored responses reveal
// nothing about their caller and clients use unguessable keys: any
// anonymous caller who sends another's key gets that caller's response.
func WithAnonymousKeys(allow bool) Option {
	return func(c *config) { c.anonymous = allow }
}

// WithMethods sets the guarded methods, compared without regard to case.
// Default POST and PATCH; an empty list keeps the default.
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
// without one gets 400 CodeKeyMissing. Default false: it passes through,
// unprotected.
func WithKeyRequired(required bool) Option {
	return func(c *config) { c.required = required }
}

// WithMismatchStatus sets the status of a CodeKeyReused answer: any 4xx,
// as given (422 by default, 409 as some APIs answer); pick one that
// clients do not retry (not 408 or 429). A value outside 400-499 means 422:
// a reused key is the client's error, never a success or the server's
// failure.
func WithMismatchStatus(status int) Option {
	return func(c *config) {
		c.mismatchStatus = http.StatusUnprocessableEntity
		if status >= 400 && status <= 499 {
			c.mismatchStatus = status
		}
	}
}

// WithMaxInProgressWait sets how long a request (or a call of Do) whose key
// is in progress waits for it to finish before it gets 409 CodeInProgress
// (ErrInProgress), polling the store every 100 ms and never past the
// request's (the call's) context. Default 0: answer at once. Negative
// values mean 0.
func WithMaxInProgressWait(d time.Duration) Option {
	return func(c *config) { c.wait = max(d, 0) }
}

// WithLease sets the lease a claim holds (default 30 s). It is heartbeated
// every lease/3 while the handler runs, a failed heartbeat tried again on
// a fresh connection; the handler's context is canceled (cause matching
// ErrLeaseLost) when the store answers ErrLeaseLost, or when no heartbeat
// got through until lease/6 is left, the margin for the servers' clocks,
// which must agree to well within it. If the process stalls and the lease
// expires, a retry or the Completer takes the record over and the stalled
// owner's writes fail with ErrLeaseLost. Set it well above the store's
// worst latency, a new connection's included. A value under the minimum,
// 3 ms (0 and negative values included), means 3 ms.
func WithLease(d time.Duration) Option {
	return func(c *config) { c.lease = max(d, minLease) }
}

// WithReplayWindow sets how long a completed response is replayed (default
// 24 h); after it a reused key is a new request. Set it above the longest
// retry chain (dead-letter replays, scheduled re-runs); math.MaxInt64 means
// forever (the Reaper then deletes no completed record). Values <= 0 keep
// the default.
func WithReplayWindow(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.replayWindow = d
		}
	}
}

// WithCleanupHorizon sets how long after its last update the Reaper keeps a
// record (default 72 h). The Reaper never uses less than the replay window
// plus the lease, so that it never deletes a record that can still be
// replayed: a shorter horizon (or <= 0) means that sum, which saturates at
// math.MaxInt64 (forever).
func WithCleanupHorizon(d time.Duration) Option {
	return func(c *config) { c.horizon = d }
}

// WithReplayHeaders adds names to the response headers that are stored and
// replayed: by default Content-Type, Content-Language, Content-Encoding,
// Content-Disposition, Content-Location, Location, Cache-Control, ETag,
// Last-Modified, Expires, Link and Vary. Cookies, Date, per-exchange ids
// (X-Request-Id, Traceparent, ...) and framing headers are never stored,
// even when named. The first answer goes out with all its headers.
func WithReplayHeaders(names ...string) Option {
	return func(c *config) { maps.Copy(c.replayHeaders, headerSet(names)) }
}

// WithMaxRequestBody sets the largest request body read and fingerprinted on
// a guarded request, and the largest Call.Payload (default 1 MiB); a larger
// one gets 413 CodeRequestTooLarge (Do: ErrInvalidCall). A value of 0 or
// less accepts no body: a guarded request with a body gets 413, one
// without runs. The middleware reads the body before the handler runs; as
// any handler's read, it is bounded in time by the server: set
// http.Server.ReadTimeout (or ReadHeaderTimeout and a read deadline
// through http.ResponseController in an outer handler).
func WithMaxRequestBody(n int64) Option {
	return func(c *config) { c.maxRequestBody = max(n, 0) }
}

// WithMaxStoredBody sets the largest response body, and the largest output
// of Do (or message of its definitive failure), stored for replay (default
// 1 MiB). A larger one still reaches its first caller and completes the
// record, but its replays answer 409 CodeResponseNotReplayable (Do:
// ErrOutputTooLarge). A value of 0 or less stores no body: only responses
// and outputs without one are replayable.
func WithMaxStoredBody(n int64) Option {
	return func(c *config) { c.maxStoredBody = max(n, 0) }
}

// WithStore5xx stores 5xx responses and replays them like any other
// (Stripe API v1). Default false: a 5xx gives the key up, so a retry runs
// again. A panic always gives it up.
func WithStore5xx(store bool) Option {
	return func(c *config) { c.store5xx = store }
}

// WithRoute sets the function that names a request's route in its scope
// and fingerprint. nil keeps the default: the ServeMux pattern that routed
// the request to the middleware (r.Pattern), unless it is empty or matches
// a subtree ("/api/", "/files/{path...}"); then the pattern of the
// *http.ServeMux the middleware wraps, if it is one and has a pattern for
// the request, else the request's path. So the inner routes of a mounted
// router are separate scopes.
func WithRoute(f func(*http.Request) string) Option {
	return func(c *config) { c.route = f }
}

// WithKeyHeader sets the request header that carries the key (default
// "Idempotency-Key"). "" keeps the default.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		if name != "" {
			c.header = http.CanonicalHeaderKey(name)
		}
	}
}

// WithShutdown sets the context whose end cancels the handlers of claimed
// requests (with context.Cause(ctx)), which the client going away does not
// cancel, and the functions of Do: pass the context you cancel to shut the
// server down. What such a
// handler answers is handled as any answer. Default none: they run to their
// end or deadline. nil keeps the default.
func WithShutdown(ctx context.Context) Option {
	return func(c *config) {
		if ctx != nil {
			c.shutdown = ctx
		}
	}
}

// WithLogger sets the logger of the middleware, its Completer and its
// Reaper (default slog.Default()); nil means no logging. The records are
// written by a logging Observer that runs before those of WithObserver;
// they name a request by method, route and key digest, never the raw key.
// What an operator must see is at Warn or above: a store unavailable or
// full, and a principal function that fails (each at most once a second),
// a key reused for a different request (a client bug), a response too
// large to be stored for replay, a handler that panicked, a lost lease, a
// store that failed at the end of a request; replays, in-progress
// conflicts and a request's own errors are at Debug.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithObserver adds o to the observers of the middleware, its Completer and
// its Reaper (default none). Each sees every event, in the order given.
func WithObserver(o Observer) Option {
	return func(c *config) { c.observers = append(c.observers, o) }
}

// WithMonitor tells the middleware where its status monitor (Monitor) is
// mounted, and the secret that seals the monitor's identifiers. path is the
// path (or absolute URL) of the monitor as clients reach it, such as
// "/operations/" ("/" is added when it does not end with one): the
// in-progress 409 and the 202 of WithAcceptAfter carry the URL of their
// operation there, path followed by its identifier, in Location. Default
// none: no Location, no 202, and the Monitor answers lookups by key only.
//
// An identifier is the request's method, route and key, and a prefix of
// its fingerprint, encrypted and authenticated (AES-256-GCM) under a key
// derived from secret (HKDF-SHA-256), with the principal as associated
// data: it reveals nothing of the key, cannot be made from the key without
// the secret, and opens only for the principal it was issued to; one
// request always gets the same identifier. secret must be at least 32
// random bytes, the same on every server of a fleet (from a secret store,
// never in code), so that any of them opens what another issued. previous
// are secrets that still open identifiers but no longer seal them: rotate
// by deploying first (old, new) as (secret, previous), so that every server
// opens identifiers sealed with new, then (new, old), then, once the 202s
// sealed with old are past the replay window, new alone. An identifier
// whose secret is gone answers 404 CodeRequestAbsent, as any unknown one;
// its client can still look the key up, or send its request again with the
// same key, which replays it. A path of "" or a secret under 32 bytes is
// refused: the monitor stays off, and New logs the reason at Error.
func WithMonitor(path string, secret []byte, previous ...[]byte) Option {
	return func(c *config) {
		c.monitorPath, c.monitorIDs, c.monitorErr = "", nil, nil
		if path == "" {
			c.monitorErr = errors.New("idempotency: WithMonitor: empty path")
			return
		}
		ids, err := newIDs(append([][]byte{secret}, previous...))
		if err != nil {
			c.monitorErr = fmt.Errorf("WithMonitor: %w", err)
			return
		}
		if !strings.HasSuffix(path, "/") {
			path += "/"
		}
		c.monitorPath, c.monitorIDs = path, ids
	}
}

// WithAcceptAfter makes a guarded request whose handler has not answered d
// after its key was claimed answer 202 Accepted, with its operation's
// monitor URL in Location and Operation-Location, Retry-After: 1 and a
// status body (docs/CONTRACT.md), while the handler runs on to its end: its
// response is stored as any other, and the monitor (Monitor) or a retry
// with the same key then gives it. It needs WithMonitor; without it, or
// with d <= 0 (the default), no request answers 202. The handler then runs
// on a goroutine of its own, which outlives ServeHTTP after a 202:
// http.Server.Shutdown does not wait for it, WithShutdown's context
// cancels it, and the Completer resumes what a stopped process left. A
// panic of a handler that answered 202 is reported to the observers
// (OutcomePanicked) and not raised again; before the 202 it goes on to
// net/http as usual.
func WithAcceptAfter(d time.Duration) Option {
	return func(c *config) { c.acceptAfter = max(d, 0) }
}

// WithOneTransaction makes the claim of a fresh key, the handler's writes
// in the request's unit (sqlstore.Tx) and the stored response commit in
// one transaction of the store's: one commit per request instead of two
// (the claim's, then the completion's), for handlers whose every effect is
// a write in the store's database. Default false: the claim commits on
// its own and the record is in progress, visible to all, while the
// handler runs.
//
// It is an option, not automatic, because it changes what others see and
// what a handler may do. While the transaction is open no in-progress
// record is visible: a request (or call of Do) with the same key waits on
// the key (bounded as the store's ClaimInUnit says: sqlstore's waits
// WithMaxInProgressWait, at least 1 s, and never past the request's
// context, on PostgreSQL and MySQL, and its busy timeout on SQLite), then
// replays the response, or runs when the first rolled back, or gets 409
// CodeInProgress (Do: an *InProgressError with RetryAfter 1 s); the
// Monitor's lookup answers absent. The lease is the transaction's: no
// heartbeat runs and nothing can take the record over; a crash or a lost
// connection rolls the claim back with the handler's writes, so there is
// nothing to resume. Phase and External, which need records in progress
// with committed recovery points, fail with ErrOneTransaction on every
// execution of such a Middleware but one that took over a record in
// progress (left, say, before the route had the option), which resumes
// its phases and completes: keep handlers with phases or External on one
// without the option. A handler that holds its transaction while it calls
// a slow service holds a connection, and on SQLite the write lock, as
// long; so does a request that waits on a key held so.
//
// A key that has a record (a replay, a conflict, a completion past the
// replay window, an expired lease) is claimed the ordinary way, and a
// record taken over or restarted so runs the multi-step lifecycle. A store
// that is not a ClaimTransactor (memstore, redisstore) runs every request
// that way; New logs it at Warn.
func WithOneTransaction(on bool) Option {
	return func(c *config) { c.oneTx = on }
}
