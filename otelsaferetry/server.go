package otelsaferetry

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
)

// Attribute keys of the server metrics, outside the semantic conventions.
const (
	// ExecutionOutcomeKey is how an execution ended (idempotency.Observer's
	// Executed: "completed", "released", "kept", ...).
	ExecutionOutcomeKey = attribute.Key("saferetry.execution.outcome")
	// ProblemCodeKey is the problem code of a refusal (idempotency.Code*).
	ProblemCodeKey = attribute.Key("saferetry.problem.code")
	// StoreOperationKey is the store call ("claim", "get", "heartbeat", ...).
	StoreOperationKey = attribute.Key("saferetry.store.operation")
	// RequestRetryKey says whether a guarded request was a retry (true:
	// its Request-Attempt above 1) or a first try (false), on the
	// executions and refusals; absent when the request carried no attempt
	// number (deadline.Attempt is 0: no deadline.Middleware in front, or a
	// client that sends none).
	RequestRetryKey = attribute.Key("saferetry.request.retry")
)

// Server metric names.
const (
	// ServerExecutions is a counter, {execution}, by outcome.
	ServerExecutions = "saferetry.server.executions"
	// ServerTakeovers is a counter, {takeover}.
	ServerTakeovers = "saferetry.server.takeovers"
	// ServerReplays is a counter, {replay}.
	ServerReplays = "saferetry.server.replays"
	// ServerRefusals is a counter, {refusal}, by problem code and status.
	ServerRefusals = "saferetry.server.refusals"
	// ServerStoreErrors is a counter, {error}, by operation.
	ServerStoreErrors = "saferetry.server.store.errors"
	// ServerStoreDuration is a histogram, s, by operation.
	ServerStoreDuration = "saferetry.server.store.duration"
	// ServerUnfinishedAge is a histogram, s: the age of the reaper's
	// unfinished records.
	ServerUnfinishedAge = "saferetry.server.unfinished.age"
)

// storeBuckets are the store-latency boundaries, in seconds: from an
// in-memory call to the 10 s bound of a store call.
var storeBuckets = []float64{
	0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10,
}

// ageBuckets are the boundaries of an unfinished record's age, in seconds:
// a minute to a week (the reaper's default horizon is 72 h).
var ageBuckets = []float64{60, 600, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 72 * 3600, 168 * 3600}

type server struct {
	executions    metric.Int64Counter
	takeovers     metric.Int64Counter
	replays       metric.Int64Counter
	refusals      metric.Int64Counter
	storeErrors   metric.Int64Counter
	storeDuration metric.Float64Histogram
	unfinished    metric.Float64Histogram
}

// ServerObserver returns an idempotency.Observer that records the server
// metrics: give it to the middleware (idempotency.WithObserver), whose
// Completer and Reaper report to it too. Metrics carry the request
// method, never the route (which may be a raw path) nor the key. It is safe
// for concurrent use.
func ServerObserver(opts ...Option) idempotency.Observer {
	m := newConfig(opts).meter()
	s := &server{}
	var err error
	if s.executions, err = m.Int64Counter(ServerExecutions, metric.WithUnit("{execution}"),
		metric.WithDescription("Handler executions of guarded requests, "+
			"by how their record was settled.")); err != nil {
		otel.Handle(err)
	}
	if s.takeovers, err = m.Int64Counter(ServerTakeovers, metric.WithUnit("{takeover}"),
		metric.WithDescription("Claims that took over an in-progress record "+
			"whose lease had expired.")); err != nil {
		otel.Handle(err)
	}
	if s.replays, err = m.Int64Counter(ServerReplays, metric.WithUnit("{replay}"),
		metric.WithDescription("Stored responses replayed.")); err != nil {
		otel.Handle(err)
	}
	if s.refusals, err = m.Int64Counter(ServerRefusals, metric.WithUnit("{refusal}"),
		metric.WithDescription("Problem answers of the middleware's own: conflicts, invalid keys, "+
			"a store unavailable or full.")); err != nil {
		otel.Handle(err)
	}
	if s.storeErrors, err = m.Int64Counter(ServerStoreErrors, metric.WithUnit("{error}"),
		metric.WithDescription("Store calls that failed "+
			"(not found, lease lost, full and too large are answers, not failures).")); err != nil {
		otel.Handle(err)
	}
	if s.storeDuration, err = m.Float64Histogram(ServerStoreDuration, metric.WithUnit("s"),
		metric.WithDescription("Latency of the store calls on the request path."),
		metric.WithExplicitBucketBoundaries(storeBuckets...)); err != nil {
		otel.Handle(err)
	}
	if s.unfinished, err = m.Float64Histogram(ServerUnfinishedAge, metric.WithUnit("s"),
		metric.WithDescription("Age of the unfinished in-progress records the reaper found."),
		metric.WithExplicitBucketBoundaries(ageBuckets...)); err != nil {
		otel.Handle(err)
	}
	return idempotency.Observer{
		Claimed: func(ctx context.Context, e idempotency.Event) {
			if e.Claim == idempotency.ClaimTakenOver {
				s.takeovers.Add(ctx, 1, metric.WithAttributes(method(e)))
			}
		},
		Executed: func(ctx context.Context, e idempotency.Event) {
			s.executions.Add(ctx, 1, metric.WithAttributes(withRetry(ctx, method(e),
				ExecutionOutcomeKey.String(string(e.Outcome)),
				semconv.HTTPResponseStatusCode(e.Status))...))
		},
		Replayed: func(ctx context.Context, e idempotency.Event) {
			s.replays.Add(ctx, 1,
				metric.WithAttributes(method(e), semconv.HTTPResponseStatusCode(e.Status)))
		},
		Refused: func(ctx context.Context, e idempotency.Event) {
			s.refusals.Add(ctx, 1, metric.WithAttributes(withRetry(ctx, method(e),
				ProblemCodeKey.String(string(e.Code)),
				semconv.HTTPResponseStatusCode(e.Status))...))
		},
		StoreCall: func(ctx context.Context, e idempotency.Event) {
			op := StoreOperationKey.String(string(e.Op))
			s.storeDuration.Record(ctx, e.Duration.Seconds(), metric.WithAttributes(op))
			if e.Err != nil && !errors.Is(e.Err, idempotency.ErrNotFound) &&
				!errors.Is(e.Err, idempotency.ErrLeaseLost) &&
				!errors.Is(e.Err, idempotency.ErrStoreFull) &&
				!errors.Is(e.Err, idempotency.ErrRecordTooLarge) {
				s.storeErrors.Add(ctx, 1, metric.WithAttributes(op))
			}
		},
		Unfinished: func(ctx context.Context, rec idempotency.Record, age time.Duration) {
			s.unfinished.Record(ctx, age.Seconds(),
				metric.WithAttributes(methodAttrKV(rec.Scope.Method)))
		},
	}
}

func method(e idempotency.Event) attribute.KeyValue { return methodAttrKV(e.Scope.Method) }

// withRetry appends RequestRetryKey to attrs when the request whose
// context is ctx carried its attempt number.
func withRetry(ctx context.Context, attrs ...attribute.KeyValue) []attribute.KeyValue {
	if n := deadline.Attempt(ctx); n > 0 {
		return append(attrs, RequestRetryKey.Bool(n > 1))
	}
	return attrs
}

func methodAttrKV(m string) attribute.KeyValue {
	return semconv.HTTPRequestMethodKey.String(methodAttr(m))
}
