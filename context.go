package saferetry

import "context"

type overrideKey struct{}

// overrides are the per-request marks carried by the context. Idempotent and
// NotIdempotent exclude each other (the last one applied wins); NoRetry
// combines with either.
type overrides struct {
	idempotency int8 // 0 unset, +1 Idempotent, -1 NotIdempotent
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
// to retry even without an idempotency key: for example a POST whose handler
// is idempotent by construction. Such a request is retried on every retryable
// outcome, a read timeout included. It replaces an earlier NotIdempotent mark
// on ctx and keeps a NoRetry mark.
func Idempotent(ctx context.Context) context.Context {
	return withOverride(ctx, func(o *overrides) { o.idempotency = +1 })
}

// NotIdempotent returns a context that marks the request made with it as
// unsafe to repeat, whatever its method: for example a PUT that appends or a
// DELETE that decrements. Such a request is retried only when it provably
// never left (a dial error, a refused HTTP/2 stream), even when it carries an
// idempotency key: servers usually honour keys on POST and PATCH only, so a
// key on a PUT proves nothing. If your server does de-duplicate this method by
// key, do not mark it. No automatic key is attached unless its method is POST
// or PATCH. It replaces an earlier Idempotent mark on ctx and keeps a NoRetry
// mark.
func NotIdempotent(ctx context.Context) context.Context {
	return withOverride(ctx, func(o *overrides) { o.idempotency = -1 })
}

// NoRetry returns a context that turns retries off for the request made with
// it: the Transport makes one attempt (net/http's own transport may still
// re-send it once on a dead keep-alive connection, as it does for any
// idempotent or keyed request). An automatic key is still attached. It keeps
// an Idempotent or NotIdempotent mark on ctx.
func NoRetry(ctx context.Context) context.Context {
	return withOverride(ctx, func(o *overrides) { o.noRetry = true })
}
