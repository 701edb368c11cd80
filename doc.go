// Package saferetry makes retried HTTP writes safe. Its Transport is an
// http.RoundTripper that retries only what is safe to retry, with full-jitter
// backoff, under one overall deadline and a retry budget shared per host,
// logging every attempt, and that attaches one stable Idempotency-Key to each
// POST and PATCH, reused by every retry of that logical request.
//
// Swap the transport of an existing client:
//
//	client := &http.Client{Transport: saferetry.NewTransport(http.DefaultTransport)}
//
// or build one: client := saferetry.NewClient(saferetry.WithMaxAttempts(3)).
//
// # What is retried
//
// Statuses 429 (honouring Retry-After), 502, 503, 504 and the idempotency
// middleware's in-progress 409 (code "idempotency_request_in_progress"); 500
// only with WithRetry500. Errors: connection refused or reset, EOF before a
// response, a per-attempt timeout, a refused HTTP/2 stream or GOAWAY. Never:
// other 4xx, TLS verification failures, the caller's own cancellation or
// deadline, or anything unrecognised. A request is retried on those outcomes
// only when it is safe to repeat: its method is GET, HEAD, OPTIONS, TRACE, PUT
// or DELETE, or it carries an idempotency key, or the caller marked it with
// Idempotent. An unsafe request without a key (a POST with WithAutoKeys(false),
// or a request marked NotIdempotent) is retried only when it provably never
// left: a dial error or a refused stream, never a read timeout.
//
// # Keys
//
// A POST or PATCH without a key gets one before its first attempt, and every
// retry reuses it. Best first: an event-derived key (keygen.Event("order-confirm",
// orderID)), deterministic so that even a retry from a restarted process
// carries it; a request-scoped key carried in the context (keygen.NewContext);
// a random UUID kept across retries, which is what the Transport attaches
// when the caller gave none. A new value per attempt is the anti-pattern: it
// turns every retry into a new request and makes duplicates certain. The
// Transport never overwrites a caller's key; an invalid one fails before any
// network I/O with an error matching ErrInvalidKey. The key used is visible
// afterwards on resp.Request.Header.
//
// The server side of the guarantee is package idempotency: with both halves,
// a logical request has its effect effectively once within the key's scope
// and the server's replay window (24 h by default). Delivery over a network
// can never be made exactly-once; de-duplication is what makes repeats harmless.
//
// # Defaults
//
//	attempts          3 in total                       WithMaxAttempts
//	backoff           full jitter, base 50 ms          WithBackoff
//	                  (1 s for 429 / 503+Retry-After),
//	                  cap 20 s
//	overall deadline  the context's, at most 30 s       WithMaxElapsed
//	per attempt       off                              WithAttemptTimeout
//	Retry-After       honoured up to 30 s               WithRetryAfterCap
//	budget            token bucket per host, shared     WithBudget, WithBudgetRegistry
//	                  process-wide: 500 tokens,
//	                  transient retry 14, throttled 5
//	keys              random UUIDv4 for POST/PATCH      WithAutoKeys, WithKeyHeader
//	deadline header   Request-Deadline-Ms sent only     WithDeadlineHeader
//	                  when the context has a deadline
//	logs              one slog record per attempt       WithLogger
//
// # Deadlines
//
// One overall deadline bounds each logical request: the earlier of the
// request context's deadline and its start plus MaxElapsed (30 s by
// default). Each attempt runs on a context canceled at the per-attempt
// timeout or at that deadline, whichever is first; no backoff sleep starts
// that would end after it. Both bound the wait for the response headers,
// never the reading of the returned body, which the caller's context alone
// governs.
//
// The time left is told to the server in the Request-Deadline-Ms header
// (package deadline) only when the caller's context has a deadline, as gRPC
// sends grpc-timeout: the Transport's own MaxElapsed bounds the loop but is
// not advertised. WithDeadlineHeader(true) sends it on every request (from
// MaxElapsed when the context has no deadline); WithDeadlineHeader(false)
// never sends it.
//
// # Plugging in
//
// WithRetryPolicy widens or narrows the allow-list per outcome with
// retry.Rule values; no rule lifts the safety rules above (nor the attempt
// limit, the deadline, the budget). WithPrepare re-signs or re-authorises
// each attempt's own copy just before it is sent (PrepareFunc). WithObserver
// installs an Observer that sees every attempt and call; the slog records of
// WithLogger are written by such an observer, and the otelsaferetry module
// turns one into OpenTelemetry metrics and spans.
//
// # Order with other resilience layers
//
// Put retries outermost: Retry, then circuit breaker, then rate limiter,
// then bulkhead, then the call. Each retry then passes through the breaker
// and the limiter like any other call.
package saferetry
