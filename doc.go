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
// The server half, package idempotency, honours the key: each keyed request
// takes effect effectively once within the key's scope and the replay
// window, its stored answer replayed to every retry, over memory,
// SQLite (embedded), PostgreSQL, MySQL/MariaDB or Redis (standalone,
// Sentinel or Cluster).
//
// This documentation is where the allow-list and the defaults are stated;
// the README and docs/CONTRACT.md link here.
//
// # What is retried
//
// Statuses 429, 502, 503, 504, and 409 with the idempotency middleware's
// problem code "idempotency_request_in_progress"; 500 only when a rule asks
// (WithRetryPolicy(retry.Status(retry.Allow, 500))). Errors: connection
// refused or reset, EOF before a response, an attempt's time limit or a
// transport timeout, a refused HTTP/2 stream, GOAWAY, a re-send of the base
// transport's that the Transport refused (see below). Never: any other
// status, TLS verification failures, the caller's own cancellation or
// deadline, or anything unrecognised.
//
// Those outcomes are retried only when the request may be repeated: its
// method is GET, HEAD, OPTIONS, TRACE, PUT or DELETE, or it carries an
// idempotency key, or the caller marked it Idempotent(ctx, true). Any other request (a
// POST with WithAutoKeys(false), a request marked Idempotent(ctx, false)) is retried
// only when it provably never left: a dial error or a refused stream, never
// a status, a reset or a timeout. No rule of WithRetryPolicy lifts that, nor
// makes a success or the caller's cancellation retryable.
//
// Before each retry, the loop stops, returning the outcome in hand, when:
// the answer is a 5xx or 429 carrying the mark "Retried-Below: true" (a
// service further down has already retried this failure; no rule lifts
// that); the caller's
// context has ended; the attempts are used up; the request
// body cannot be sent again; the server's Retry-After exceeds
// WithMaxRetryAfter; the wait would end after the overall deadline; the
// retry budget refuses. The wait is the backoff, or the server's
// Retry-After (429, 503, the in-progress 409) when longer.
//
// On a 429 or 503 without a valid Retry-After, the RateLimit field
// (draft-ietf-httpapi-ratelimit-headers) stands for it: when an item's
// remaining quota r is 0, the server asks for its effective window t
// (RateLimit: "default";r=0;t=30 is 30 s), or without t for the window w of
// the RateLimit-Policy item of the same name, the longest when several are
// spent. That wait is bounded as Retry-After is (WithMaxRetryAfter, the
// deadline), and a malformed field is ignored whole. A 503 asking for no
// wait (Retry-After: 0) waits no longer than one asking nothing: it is a
// transient failure, not throttling. X-RateLimit-Reset is never read: APIs
// send it as an epoch time or as seconds left, so any reading of it is a
// guess that either ignores the limit or asks for decades (which stops the
// loop); an API that sends only it can be served by a base RoundTripper
// that turns it into Retry-After, where its meaning is known.
//
// # Defaults
//
//	attempts          3 in all, the first included      WithMaxAttempts
//	backoff           full jitter, base 50 ms           WithBackoff
//	                  (1 s for 429, a 503 asking
//	                  for a wait, the in-progress
//	                  409), cap 20 s
//	overall deadline  the context's, at most 30 s       WithMaxElapsed
//	per attempt       none                              WithAttemptTimeout
//	Retry-After       honoured up to 30 s, and a        WithMaxRetryAfter
//	                  spent RateLimit quota's window
//	budget            token bucket per host, shared     WithBudget
//	                  process-wide: 500 tokens, a
//	                  transient retry costs 14, a
//	                  throttled one 5, a retried
//	                  success refunds its cost, a
//	                  first-try success adds 1, and
//	                  time 500 a minute (package
//	                  budget)
//	keys              random UUIDv4 for POST and PATCH  WithAutoKeys, WithKeyHeader
//	                  without a key, in Idempotency-Key
//	request body      GetBody, or bodies up to 1 MiB    WithMaxBufferedBody
//	                  buffered; larger ones sent once
//	deadline header   Request-Deadline-Ms, only when    WithDeadlineHeader
//	                  the context has a deadline
//	attempt header    Request-Attempt on every attempt  WithAttemptHeader
//	                  (1 for the first)
//	logs              one slog record per attempt,      WithLogger
//	                  to slog.Default()
//	hedging           off; with Hedging{} the delay     WithHedging
//	                  is the host's recent p95
//	                  (5 ms..10 s), one hedge
//	rules, hooks      none                              WithRetryPolicy, WithPrepare,
//	                                                    WithObserver
//
// Per request, through its context: Idempotent(ctx, true or false), NoRetry.
//
// # Keys
//
// A POST or PATCH without a key gets one before its first attempt, and every
// retry reuses it. Best first: an event-derived key (keygen.Event), the same
// in every process that handles the event; a request-scoped key carried in
// the context (keygen.NewContext); a random UUID kept across retries, which
// is what the Transport attaches when the caller gave none. A new value per
// attempt is the anti-pattern: it makes every retry a new request. The
// Transport never overwrites a caller's key; an invalid one fails before
// any network I/O with an error matching keygen.ErrInvalidKey, which names
// the key by its digest, never its bytes. No error text the Transport
// returns, logs or gives its observers holds the key: where a server
// echoed it into the base transport's error, it reads "[key <digest>]".
// The key sent is on resp.Request.Header, and on retry.ExhaustedError.Key.
//
// Automatic keys make a POST retryable on every allow-listed outcome,
// timeouts included: that is safe only against a server that de-duplicates
// by key (package idempotency, Stripe, others); against one that does not,
// use WithAutoKeys(false). With both halves, a logical request takes effect
// effectively once within the key's scope and the server's replay window;
// nothing over a network is delivered exactly once. When the loop ends
// without a definitive answer (Definitive: an error, a final 429, 502, 503
// or 504, the in-progress 409, a 202 with a monitor), the outcome is
// unknown: look the key up (Transport.Lookup), or send the request again
// later with the same key, never a new one.
//
// # Every request on the wire is an attempt
//
// net/http's Transport sends a request again by itself when the kept-alive
// connection it rode closed before the answer and the request is a GET,
// HEAD, OPTIONS or TRACE or carries an Idempotency-Key or
// X-Idempotency-Key field (and has no body, or a GetBody), and goes on for
// as long as the connection it picks next is one more that died; its
// HTTP/2 transport does so for a stream the server refused or did not
// process (REFUSED_STREAM, a GOAWAY), up to 7 times, the first at once,
// then after 1 s, 2 s, 4 s and on. Against a provider that ignores keys, a
// re-send of a keyed POST is a second charge. The Transport makes every
// send an attempt of its own, numbered, logged, told to the observers and
// charged:
//
//   - An attempt with a body carries a GetBody that refuses, so that
//     net/http never sends it again: the re-send fails before anything is
//     written (class retry.ClassResend), and the loop decides the retry as
//     any other, after its backoff, when net/http would have judged it safe
//     (the request may be repeated, or the server did not process it,
//     whatever the method).
//   - An attempt without a body cannot be kept from a re-send without
//     sending a body, which would change what the server sees. The
//     Transport sees each of its sends (httptrace's GotConn, on the
//     attempt's context, composed with any trace of the caller's) and makes
//     a re-send the next attempt before it is written: the send before it
//     is told done as retried at once (class retry.ClassResend, no wait);
//     the re-send takes the next number, in its Request-Attempt field, is
//     logged and told to the observers, counts toward WithMaxAttempts, and
//     is charged to the retry budget as a transient retry. It is on its
//     way when the Transport learns of it, so nothing refuses it: past the
//     attempt limit (NoRetry included), for a request marked
//     Idempotent(ctx, false), or with the budget spent (it then goes
//     uncharged), it is counted all the same. It goes as the attempt was
//     prepared: WithPrepare does not run again.
//
// A base transport that reads GetBody itself (to sign the payload) gets the
// refusal too: sign in WithPrepare, which sees the request's own GetBody.
// One that makes requests of its own with the attempt's context has their
// sends counted as re-sends (a preparation's are not).
//
// # Deadlines
//
// One overall deadline bounds each logical request: the earlier of the
// context's deadline and the start plus WithMaxElapsed. Each attempt has a
// time limit, the earlier of WithAttemptTimeout and that deadline, which
// covers everything the Transport does with the attempt: sending it,
// waiting for the headers, classifying the response and peeking at a 409's
// problem code. It stops when the response is handed to the caller, whose
// context alone then governs the body, or when a hedged round sets the
// answer aside while its other attempts run, whose limits bound that wait.
// No wait starts that would end after the overall deadline, and no attempt
// starts once it has passed.
//
// The Transport's own reads of a body have bounds of their own, which hold
// with no deadline at all: the peek at a 409's problem code at most 4 KiB
// and 1 s (a peek that runs out is an attempt timeout, ErrAttemptTimeout);
// the drain of an answer it discards at most 64 KiB, within the wait before
// the retry (the sleep is what is left of the wait; an unfinished body is
// closed and its connection dropped), or, for an answer a hedged round
// discards, beside the round for at most 1 s. No goroutine of the
// Transport outlives the body RoundTrip returns: closing it ends those
// drains, and RoundTrip that returns an error ends them before it returns.
//
// The time left is told to the server in the Request-Deadline-Ms header
// (package deadline) only when the caller's context has a deadline, as gRPC
// sends grpc-timeout: WithMaxElapsed bounds the loop but is not advertised.
//
// # Hedging
//
// WithHedging cuts the tail latency a straggling server gives: when the
// attempts in flight have had no response headers for the hedge delay, the
// Transport sends one more, a hedge, beside them (up to Hedging.MaxHedges at
// once). The first final answer, one the loop would not retry, wins; only
// the losers are canceled, and the winner's context lives until its body
// is closed. A retryable answer (a 503, the in-progress 409) or an error
// from one attempt while another is in flight is set aside, and the
// Transport waits for the others: a hedge never makes the answer worse, and
// once an attempt has failed, what follows is a retry, after its backoff.
//
// A hedge is safe for a write: only a request that may be sent again
// whatever its outcome is hedged, and a POST or PATCH only with an
// idempotency key, which every hedge carries, so that the idempotency
// middleware answers the losers with the in-progress 409 or the replay and
// the effect happens once. Hedges are attempts: they count in
// WithMaxAttempts with the retries and carry their own Request-Attempt
// number; one overall deadline bounds them all; each spends the host's
// retry budget as a transient retry does, and when the budget denies, no
// hedge starts and no attempt in flight is killed; no hedge follows an
// answer marked "Retried-Below: true" or one with a Retry-After. Observers
// and logs see each hedge as an attempt (AttemptStartInfo.Hedge), an
// attempt that lost as OutcomeLost, and one set aside as OutcomeDiscarded.
//
// # Across a chain of services
//
// Retries multiply across layers (docs/CHAIN.md counts them), so one layer
// retries and the layers above do not. When a service runs behind
// deadline.Middleware and its handlers call other services with a
// Transport and the request's context (req.WithContext(r.Context())), the
// middleware marks the service's own 5xx or 429 answer "Retried-Below:
// true" when one of those calls:
//
//   - gave up on a retryable failure: the attempts used up after retrying
//     (retry.ReasonMaxAttempts, when more than one was allowed), or the
//     budget, the deadline or a Retry-After longer than WithMaxRetryAfter
//     refusing a retry, the first included (retry.ReasonBudget,
//     retry.ReasonDeadline, retry.ReasonRetryAfterTooLong);
//   - was retried and ended in an error, a 5xx or a 429, whatever stopped
//     it (a failure that is not retryable, the caller's cancellation, a
//     body that cannot be sent again);
//   - received a 5xx or 429 answer carrying the mark
//     (retry.ReasonRetriedBelow).
//
// A Transport never retries a marked answer. So one layer retries and the
// layers above do not. Package deadline has the details, docs/CONTRACT.md
// the headers.
//
// # Long operations and unknown outcomes
//
// A server may answer a request that runs long with 202 Accepted and the
// URL of a status monitor (the idempotency middleware's WithAcceptAfter).
// With WithFollowAccepted the Transport follows it under the same overall
// deadline and key, honouring its Retry-After up to WithMaxRetryAfter, and
// returns the operation's response or a *FollowError. A poll is not an
// attempt: it takes nothing from the budget, has no attempt number, and is
// seen as a poll (Observer.Poll) and logged as one.
//
// When the loop ends without a definitive answer (Definitive), ask before
// sending again: Transport.Lookup asks the server's monitor what became of
// the request's key, without its body, and says absent (send it again with
// the same key), in progress, or completed (with the stored response); a
// server without a monitor gives ErrNoMonitor, and the request is sent
// again with the same key. docs/CONTRACT.md has the wire contract.
//
// # Plugging in
//
// WithRetryPolicy widens or narrows the allow-list per outcome with
// retry.Rule values. WithPrepare re-signs or re-authorises each attempt's
// own copy just before it is sent. WithObserver installs an
// Observer that sees every attempt and call; the slog records of WithLogger
// come from such an observer, and the otelsaferetry module turns one into
// OpenTelemetry metrics and spans. Labels (Outcome, retry.Class,
// retry.Reason) are snake_case.
//
// # Order with other resilience layers
//
// Put retries outermost: Retry, then circuit breaker, then rate limiter,
// then bulkhead, then the call. Each retry then passes through the breaker
// and the limiter like any other call.
package saferetry
