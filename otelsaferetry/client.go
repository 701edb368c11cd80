package otelsaferetry

import (
	"context"
	"net/http"
	"net/url"
	"strconv"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// Attribute keys of this package, outside the semantic conventions.
const (
	// AttemptClassKey is the class of an attempt's outcome (a retry.Class:
	// "ok", "status_503", "conn_refused", ...), absent on an attempt that
	// lost to a hedge, whose outcome is never read.
	AttemptClassKey = attribute.Key("saferetry.attempt.class")
	// AttemptOutcomeKey is what the loop did after an attempt (a
	// saferetry.Outcome: "retry", "final", "stopped", and for hedged
	// requests "lost" or "discarded").
	AttemptOutcomeKey = attribute.Key("saferetry.attempt.outcome")
	// AttemptHedgeKey is true on the span and the attempts of a hedge
	// (saferetry.WithHedging), and absent on every other attempt.
	AttemptHedgeKey = attribute.Key("saferetry.attempt.hedge")
	// RetryClassKey is the class of the outcome that a retry retries, or
	// that the budget refused to retry; absent on a hedge, which retries
	// nothing.
	RetryClassKey = attribute.Key("saferetry.retry.class")
	// StopReasonKey is why the loop stopped (a retry.Reason:
	// "max_attempts", "budget_denied", "deadline", "retry_after_too_long",
	// ...), on an attempt or call whose outcome is "stopped".
	StopReasonKey = attribute.Key("saferetry.stop.reason")
	// KeyDigestKey is the digest of the idempotency key (keygen.Digest),
	// never the key itself.
	KeyDigestKey = attribute.Key("saferetry.idempotency_key.digest")
)

// Client metric names.
const (
	// ClientAttempts is a counter, {attempt}.
	ClientAttempts = "saferetry.client.attempts"
	// ClientRetries is a counter, {retry}, by saferetry.retry.class.
	ClientRetries = "saferetry.client.retries"
	// ClientBudgetDenials is a counter, {denial}, by saferetry.retry.class.
	ClientBudgetDenials = "saferetry.client.budget.denials"
	// ClientExhausted is a counter, {call}, by saferetry.stop.reason.
	ClientExhausted = "saferetry.client.exhausted"
	// ClientRetryWait is a histogram, s.
	ClientRetryWait = "saferetry.client.retry.wait"
)

// waitBuckets are the wait histogram's boundaries, in seconds: from the
// 50 ms base of transient retries to the 30 s Retry-After cap.
var waitBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30}

type client struct {
	tracer        trace.Tracer
	attempts      metric.Int64Counter
	retries       metric.Int64Counter
	budgetDenials metric.Int64Counter
	exhausted     metric.Int64Counter
	wait          metric.Float64Histogram
}

func newClient(c config) *client {
	m := c.meter()
	cl := &client{tracer: c.tracer()}
	var err error
	if cl.attempts, err = m.Int64Counter(ClientAttempts, metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts sent by the saferetry Transport, "+
			"by outcome class and what the loop did next.")); err != nil {
		otel.Handle(err)
	}
	if cl.retries, err = m.Int64Counter(ClientRetries, metric.WithUnit("{retry}"),
		metric.WithDescription(
			"Retries decided, by the class of the outcome retried.")); err != nil {
		otel.Handle(err)
	}
	if cl.budgetDenials, err = m.Int64Counter(ClientBudgetDenials, metric.WithUnit("{denial}"),
		metric.WithDescription("Retries the retry budget refused.")); err != nil {
		otel.Handle(err)
	}
	if cl.exhausted, err = m.Int64Counter(ClientExhausted, metric.WithUnit("{call}"),
		metric.WithDescription("Calls that stopped while their outcome could have been retried, "+
			"by reason.")); err != nil {
		otel.Handle(err)
	}
	if cl.wait, err = m.Float64Histogram(ClientRetryWait, metric.WithUnit("s"),
		metric.WithDescription("Sleep chosen before a retry."),
		metric.WithExplicitBucketBoundaries(waitBuckets...)); err != nil {
		otel.Handle(err)
	}
	return cl
}

// ClientOptions returns the saferetry options that instrument a Transport:
// an observer (saferetry.WithObserver) that records the client metrics and
// one span per attempt, and a preparation (saferetry.WithPrepare) that
// injects each attempt's span context into its headers with the configured
// propagators (traceparent with the W3C propagator), so that the server's
// span is the attempt's child; with propagators that inject nothing
// (WithPropagators(propagation.NewCompositeTextMapPropagator())), the
// headers are left alone. Give them to saferetry.NewTransport with the other
// options: the preparation runs before any WithPrepare given after it (a
// signature must come last, over the trace headers). They are safe for
// concurrent use.
func ClientOptions(opts ...Option) []saferetry.Option {
	c := newConfig(opts)
	cl := newClient(c)
	prop := c.propagators
	inject := func(r *http.Request, _ int) error {
		prop.Inject(r.Context(), propagation.HeaderCarrier(r.Header))
		return nil
	}
	return []saferetry.Option{saferetry.WithObserver(cl.observer()), saferetry.WithPrepare(inject)}
}

func (cl *client) observer() saferetry.Observer {
	return saferetry.Observer{
		AttemptStart: cl.attemptStart, AttemptDone: cl.attemptDone, CallDone: cl.callDone,
	}
}

// spanKey keeps the attempt's span in its context, so that AttemptDone ends
// this span even when a later observer put another one in the context.
type spanKey struct{}

func (cl *client) attemptStart(ctx context.Context, a saferetry.AttemptStartInfo) context.Context {
	r := a.Request
	method := methodAttr(r.Method)
	attrs := make([]attribute.KeyValue, 0, 8)
	attrs = append(attrs, semconv.HTTPRequestMethodKey.String(method),
		semconv.ServerAddress(r.URL.Hostname()))
	if p := port(r.URL); p > 0 {
		attrs = append(attrs, semconv.ServerPort(p))
	}
	attrs = append(attrs, semconv.URLFull(redactedURL(r.URL)))
	if a.Attempt > 1 {
		attrs = append(attrs, semconv.HTTPRequestResendCount(a.Attempt-1))
	}
	if a.Retrying != "" {
		attrs = append(attrs, RetryClassKey.String(string(a.Retrying)))
	}
	if a.Hedge {
		attrs = append(attrs, AttemptHedgeKey.Bool(true))
	}
	if a.Key != "" {
		attrs = append(attrs, KeyDigestKey.String(keygen.Digest(a.Key)))
	}
	name := method
	if name == "_OTHER" {
		name = "HTTP"
	}
	ctx, span := cl.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attrs...))
	return context.WithValue(ctx, spanKey{}, span)
}

func (cl *client) attemptDone(ctx context.Context, a saferetry.AttemptDoneInfo) {
	r := a.Request
	host := semconv.ServerAddress(r.URL.Hostname())
	method := semconv.HTTPRequestMethodKey.String(methodAttr(r.Method))
	attrs := make([]attribute.KeyValue, 0, 6)
	attrs = append(attrs, method, host, AttemptOutcomeKey.String(string(a.Outcome)))
	if a.Decision.Class != "" {
		attrs = append(attrs, AttemptClassKey.String(string(a.Decision.Class)))
	}
	if a.Outcome == saferetry.OutcomeStopped {
		attrs = append(attrs, StopReasonKey.String(string(a.Stop)))
	}
	if a.Hedge {
		attrs = append(attrs, AttemptHedgeKey.Bool(true))
	}
	cl.attempts.Add(ctx, 1, metric.WithAttributes(attrs...))
	switch {
	case a.Outcome == saferetry.OutcomeRetry:
		retried := RetryClassKey.String(string(a.Decision.Class))
		cl.retries.Add(ctx, 1, metric.WithAttributes(method, host, retried))
		cl.wait.Record(ctx, a.Wait.Seconds(), metric.WithAttributes(host, retried))
	case a.Stop == retry.ReasonBudget:
		denied := RetryClassKey.String(string(a.Decision.Class))
		cl.budgetDenials.Add(ctx, 1, metric.WithAttributes(host, denied))
	}

	span, ok := ctx.Value(spanKey{}).(trace.Span)
	if !ok {
		return
	}
	span.SetAttributes(attrs[2:]...) // outcome, class, the stop reason, the hedge flag
	switch {
	case a.Response != nil:
		code := a.Response.StatusCode
		span.SetAttributes(semconv.HTTPResponseStatusCode(code))
		if code >= 400 {
			// A client span with a 4xx or 5xx is an error (HTTP semantic
			// conventions).
			span.SetAttributes(semconv.ErrorTypeKey.String(strconv.Itoa(code)))
			span.SetStatus(codes.Error, "")
		}
	case a.Err != nil:
		span.SetAttributes(semconv.ErrorTypeKey.String(string(a.Decision.Class)))
		span.SetStatus(codes.Error, a.Err.Error())
	}
	span.End()
}

func (cl *client) callDone(ctx context.Context, c saferetry.CallDoneInfo) {
	if c.Outcome != saferetry.OutcomeStopped {
		return
	}
	r := c.Request
	cl.exhausted.Add(ctx, 1, metric.WithAttributes(
		semconv.HTTPRequestMethodKey.String(methodAttr(r.Method)),
		semconv.ServerAddress(r.URL.Hostname()), StopReasonKey.String(string(c.Stop))))
}

// methodAttr is the http.request.method value: the known methods as they
// are, "" as GET, any other as "_OTHER" (HTTP semantic conventions).
func methodAttr(m string) string {
	switch m {
	case "":
		return http.MethodGet
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return m
	}
	return "_OTHER"
}

// port is the URL's port, or the scheme's default.
func port(u *url.URL) int {
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil {
			return 0
		}
		return n
	}
	switch u.Scheme {
	case "http":
		return 80
	case "https":
		return 443
	}
	return 0
}

// sensitiveQuery are the query parameters whose values url.full redacts
// (HTTP semantic conventions).
var sensitiveQuery = []string{"AWSAccessKeyId", "Signature", "sig", "X-Goog-Signature"}

// redactedURL is u without credentials: user info and the values of
// sensitive query parameters replaced by "REDACTED".
func redactedURL(u *url.URL) string {
	c := *u
	if c.User != nil {
		c.User = url.UserPassword("REDACTED", "REDACTED")
	}
	if c.RawQuery != "" {
		q := c.Query()
		changed := false
		for _, k := range sensitiveQuery {
			if q.Has(k) {
				q.Set(k, "REDACTED")
				changed = true
			}
		}
		if changed {
			c.RawQuery = q.Encode()
		}
	}
	return c.String()
}
