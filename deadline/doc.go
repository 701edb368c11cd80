// Package deadline is the server side of what a saferetry Transport tells
// the services it calls: [Middleware] reads it and puts a record of the
// request in the request's context. It carries three things.
//
// The deadline. When the request's context has a deadline, each attempt
// carries the time left before the loop's overall deadline in the [Header]
// request header, as gRPC carries grpc-timeout. Middleware applies it to the
// request context with context.WithTimeout, bounded by 5 minutes, so that
// handlers (and the idempotency middleware) stop work the client has already
// given up on. A propagated deadline never extends a deadline the context
// already has. The value is the remaining time in whole milliseconds as a
// non-negative decimal integer, rounded down. Clocks need not be
// synchronised, because only a duration crosses the network; the time the
// request spends in flight is not subtracted, so the server's view is
// slightly generous.
//
// The attempt number. Each attempt carries its number in the
// Request-Attempt header, 1 for the first (so that "first try" differs from
// "no information"). Middleware keeps it in the record: [Attempt] returns it
// to handlers, access logs and observers (the idempotency middleware's
// observers receive the request's context), so that an operator can see
// what share of a service's load is retries.
//
// Pushback, across a chain of services. Retries multiply across layers
// (docs/CHAIN.md counts them), so one layer retries and the layers above do
// not. A saferetry
// Transport whose request is made with the context of a request served
// behind Middleware (req.WithContext(r.Context()), as handlers do) notes in
// the record when its call:
//
//   - gave up on a retryable failure: the attempts used up after retrying
//     (retry.ReasonMaxAttempts, when more than one was allowed), or the
//     retry budget, the deadline or a Retry-After longer than the Transport
//     waits refusing a retry, the first included (retry.ReasonBudget,
//     retry.ReasonDeadline, retry.ReasonRetryAfterTooLong);
//   - was retried and ended in an error, a 5xx or a 429, whatever stopped
//     it (a failure that is not retryable, the caller's cancellation, a
//     body that cannot be sent again);
//   - received a 5xx or 429 answer carrying the mark
//     (retry.ReasonRetriedBelow).
//
// Middleware then marks that request's own 5xx or 429 answer with
// "Retried-Below: true", set before the status is written, and a saferetry
// Transport never retries a marked answer, whatever its rules. The mark
// climbs the whole chain: a service whose call below received a marked
// answer marks its own failure too. Handlers need no code change: the
// response writer has the optional interfaces of the server's own
// (http.Flusher, http.Hijacker, http.CloseNotifier, http.Pusher: see
// Middleware) and keeps http.ResponseController working. A handler whose
// calls below retry through another client (an AWS SDK, gRPC) may set
// "Retried-Below: true" on its own 5xx or 429 answer itself when that
// client gave up after retrying.
//
// Both headers, their syntax and their meaning, for clients in other
// languages, are in docs/CONTRACT.md.
package deadline
