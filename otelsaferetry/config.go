package otelsaferetry

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Option configures the instrumentation.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	meterProvider  metric.MeterProvider
	tracerProvider trace.TracerProvider
	propagators    propagation.TextMapPropagator
}

func newConfig(opts []Option) config {
	var c config
	for _, o := range opts {
		if o != nil {
			o.apply(&c)
		}
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	if c.tracerProvider == nil {
		c.tracerProvider = otel.GetTracerProvider()
	}
	if c.propagators == nil {
		c.propagators = otel.GetTextMapPropagator()
	}
	return c
}

func (c config) meter() metric.Meter {
	return c.meterProvider.Meter(ScopeName, metric.WithInstrumentationVersion(version))
}

func (c config) tracer() trace.Tracer {
	return c.tracerProvider.Tracer(ScopeName, trace.WithInstrumentationVersion(version))
}

// WithMeterProvider sets the meter provider (default the global one,
// otel.GetMeterProvider(), as it is when the instrumentation is built). A nil
// provider is ignored.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) {
		if mp != nil {
			c.meterProvider = mp
		}
	})
}

// WithTracerProvider sets the tracer provider (default the global one,
// otel.GetTracerProvider(), as it is when the instrumentation is built). A
// nil provider is ignored.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) {
		if tp != nil {
			c.tracerProvider = tp
		}
	})
}

// WithPropagators sets the propagators that ClientOptions uses to inject
// each attempt's span into its request headers (default the global ones,
// otel.GetTextMapPropagator()). A nil value is ignored.
func WithPropagators(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) {
		if p != nil {
			c.propagators = p
		}
	})
}
