package bench

import (
	"context"
	"net/http"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/otelsaferetry"
)

// discardSpans is a span exporter that drops every span.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

// newSafeRetryOTel is the saferetry-otel contender: saferetry with
// otelsaferetry.ClientOptions on real SDK providers. The meter provider
// aggregates into a ManualReader that nobody collects; the tracer provider
// samples every span (the SDK's default sampler) and hands it, synchronously,
// to an exporter that drops it. What it measures is the instrumentation and
// the SDK's per-span and per-measurement work, not an exporter's.
func newSafeRetryOTel(base http.RoundTripper, _ Waits) http.RoundTripper {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(discardSpans{}))
	opts := append([]saferetry.Option{saferetry.WithLogger(DiscardLogger)},
		otelsaferetry.ClientOptions(otelsaferetry.WithMeterProvider(mp), otelsaferetry.WithTracerProvider(tp))...)
	return saferetry.NewTransport(base, opts...)
}

// newSafeRetryObserved is the saferetry-observer contender: saferetry with
// one Observer whose three functions do nothing, to show what the observer
// mechanism itself costs.
func newSafeRetryObserved(base http.RoundTripper, _ Waits) http.RoundTripper {
	nop := saferetry.Observer{
		AttemptStart: func(ctx context.Context, _ saferetry.AttemptStartInfo) context.Context { return ctx },
		AttemptDone:  func(context.Context, saferetry.AttemptDoneInfo) {},
		CallDone:     func(context.Context, saferetry.CallDoneInfo) {},
	}
	return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger), saferetry.WithObserver(nop))
}
