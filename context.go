package saferetry

import "context"

type overrideKey struct{}

type override int

const (
	overrideNone override = iota
	overrideIdempotent
	overrideNotIdempotent
	overrideNoRetry
)

func withOverride(ctx context.Context, o override) context.Context {
	return context.WithValue(ctx, overrideKey{}, o)
}

func overrideFrom(ctx context.Context) override {
	o, _ := ctx.Value(overrideKey{}).(override)
	return o
}

// Idempotent returns a context that marks the request made with it as safe
// to retry even without an idempotency key: for example a POST whose handler
// is idempotent by construction. Such a request is retried on every retryable
// outcome, a read timeout included.
func Idempotent(ctx context.Context) context.Context {
	return withOverride(ctx, overrideIdempotent)
}

// NotIdempotent returns a context that marks the request made with it as
// unsafe to retry, whatever its method: for example a PUT that appends or a
// DELETE that decrements. Without a key such a request is retried only when
// it provably never left (a dial error, a refused HTTP/2 stream); a key set by
// the caller still makes it retryable. No automatic key is attached to it
// unless its method is POST or PATCH.
func NotIdempotent(ctx context.Context) context.Context {
	return withOverride(ctx, overrideNotIdempotent)
}

// NoRetry returns a context that turns retries off for the request made with
// it: exactly one attempt. An automatic key is still attached.
func NoRetry(ctx context.Context) context.Context {
	return withOverride(ctx, overrideNoRetry)
}
