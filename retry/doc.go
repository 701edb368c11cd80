// Package retry decides whether one attempt of an HTTP request may be
// retried, parses Retry-After, and defines the error returned when the
// saferetry Transport gives up.
//
// The decision is an allow-list ([Classify]): only outcomes known to be
// transient are retried, everything else is returned to the caller at once.
//
//   - Statuses: 429, 502, 503, 504, and 409 carrying the idempotency
//     middleware's in-progress problem code ([ProblemInProgress]); 500 only
//     when [Policy].Retry500 is set. Every other status, including
//     [ProblemKeyReused] conflicts, is final.
//   - Errors: dial errors such as connection refused and HTTP/2
//     REFUSED_STREAM (the request provably never reached the server),
//     connection reset, EOF before a response, a per-attempt timeout, and
//     HTTP/2 GOAWAY. TLS verification failures, the caller's own
//     cancellation or deadline, and anything unrecognised are final.
//   - A request that is not idempotent (POST or PATCH without an
//     Idempotency-Key, or a caller override) is retried only when the
//     request provably never left, never after a status or a timeout.
//
// A user's policy widens or narrows the allow-list with [Rule]s in
// [Policy].Rules (for example [Status](Allow, 500) on one host through
// [OnRequest]); the last rule above, and never retrying the caller's own
// cancellation, hold whatever a Rule says.
//
// Everything here is pure: no I/O, no clocks (time is a parameter), no
// goroutines, and every function is safe for concurrent use.
package retry
