// Package deadline does the time arithmetic of a retry loop and carries
// the caller's remaining time to the server.
//
// Client side: [Overall] fixes one deadline for a whole logical request (the
// earlier of the context's deadline and start + MaxElapsed, default
// [DefaultMaxElapsed]); [AttemptTimeout] bounds each attempt by the
// per-attempt timeout and the time left; [SleepFits] says whether a backoff
// sleep would end before the deadline, so the loop never sleeps in vain; and
// [Propagate] writes the remaining time into the [Header] request header of
// each attempt.
//
// Server side: [Middleware] reads that header and applies it to the request
// context with context.WithTimeout, bounded by [MaxPropagated], so handlers
// (and the idempotency middleware) stop work the client has already given up
// on. A propagated deadline never extends a deadline the context already
// has.
//
// The wire format is deliberately simple: the header value is the remaining
// time in whole milliseconds as a non-negative decimal integer, rounded
// down ([Format], [Parse]). Clocks need not be synchronised, because only a
// duration crosses the network; the time the request spends in flight is not
// subtracted, so the server's view is slightly generous.
//
// Every function takes the current time as a parameter (no hidden clock)
// except Middleware, which uses the real clock through context.WithTimeout.
// All functions are safe for concurrent use.
package deadline
