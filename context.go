package saferetry

import "context"

type overrideKey struct{}

// overrides are the per-request marks carried by the context: the last
// Idempotent mark wins; NoRetry combines with it.
type overrides struct {
	idempotency int8 // 0 unset, +1 Idempotent(ctx, true), -1 Idempotent(ctx, false)
	noRetry     bool
}

func withOverride(ctx context.Context, f func(*overrides)) context.Context {
	o := overridesFrom(ctx)
	f(&o)
	return context.WithValue(ctx, overrideKey{}, o)
}

func overridesFrom(ctx context.Context) overrides {
	o, _ := ctx.Value(overrideKey{}).(overrides)
	return o
}

// Idempotent returns a context that marks the request made with it as safe
// to repeat (idempotent true) or not (false), whatever its method.
//
// true: for example a POST whose handler is idempotent by construction. It
// is retried on every allow-listed outcome, a read timeout included, even
// without a key.
//
// false: for example a PUT that appends or a DELETE that decrements. It is
// retried only when it provably never left (a dial error, a refused HTTP/2
// stream), even with an idempotency key: servers usually honour keys on POST
// and PATCH only, so a key on a PUT proves nothing (if your server does
// de-duplicate this method by key, do not mark it). No automatic key is
// attached unless its method is POST or PATCH.
//
// A later mark replaces an earlier one on ctx; a NoRetry mark stays.
func Idempotent(ctx context.Context, idempotent bool) context.Context {
	v := int8(-1)
	if idempotent {
		v = +1
	}
	return withOverride(ctx, func(o *overrides) { o.idempotency = v })
}

// NoRetry returns a context that turns retries off for the request made with
// it: the Transport makes one attempt and retries nothing. net/http may
// still send a request without a body again by itself (a kept-alive
// connection that died before the answer, an HTTP/2 stream the server did
// not process), which the Transport counts as attempt 2, past the limit
// (see the package documentation). An automatic key is still attached. It
// keeps an Idempotent mark on ctx.
func NoRetry(ctx context.Context) context.Context {
	return withOverride(ctx, func(o *overrides) { o.noRetry = true })
}
