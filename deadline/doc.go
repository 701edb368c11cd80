// Package deadline carries the caller's remaining time from a saferetry
// Transport to the server, as gRPC carries grpc-timeout.
//
// The client side is the Transport's: when the request's context has a
// deadline, each attempt carries the time left before the loop's overall
// deadline in the [Header] request header. The server side is [Middleware]:
// it reads that header and applies it to the request context with
// context.WithTimeout, bounded by 5 minutes, so that handlers (and the
// idempotency middleware) stop work the client has already given up on. A
// propagated deadline never extends a deadline the context already has.
//
// The wire format is deliberately simple: the remaining time in whole
// milliseconds as a non-negative decimal integer, rounded down. Clocks need
// not be synchronised, because only a duration crosses the network; the time
// the request spends in flight is not subtracted, so the server's view is
// slightly generous.
package deadline
