// Package otelsaferetry reports what saferetry does to OpenTelemetry: the
// client Transport's attempts, retries, budget denials, exhausted calls and
// waits as metrics, each attempt as a span, and the idempotency
// middleware's claims, replays, refusals and store latency as metrics.
//
// It is built on the observers of the saferetry Transport
// (saferetry.Observer) and of the idempotency middleware
// (idempotency.Observer), in a module of its own so that the saferetry
// module does not depend on OpenTelemetry:
//
//	tr := saferetry.NewTransport(nil, otelsaferetry.ClientOptions()...)
//
//	obs := otelsaferetry.ServerObserver()
//	mw := idempotency.New(store, idempotency.WithObserver(obs)) // its Completer and Reaper too
//
// The meter and tracer come from the global providers unless
// WithMeterProvider or WithTracerProvider says otherwise; the instrumentation
// scope is ScopeName, this package's import path.
//
// Spans follow the OpenTelemetry semantic conventions for HTTP clients: one
// span of kind client per attempt (a resend is a new span), child of the
// caller's span, named after the method, with http.request.resend_count on
// resends (a hedge is one, with saferetry.attempt.hedge). The idempotency
// key never appears: only its digest
// (keygen.Digest). Metric and attribute names outside the conventions are
// under "saferetry.".
package otelsaferetry
