package otelsaferetry

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// quick are the Transport options of these tests: microsecond waits, an
// unlimited budget, no logs.
func quick(opts ...saferetry.Option) []saferetry.Option {
	return append([]saferetry.Option{
		saferetry.WithBackoff(jitter.Config{Base: time.Microsecond, ThrottleBase: time.Microsecond, Cap: time.Microsecond}),
		saferetry.WithBudget(budget.Unlimited()),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)),
	}, opts...)
}

// server answers with the given statuses in order (the last repeats) and
// keeps the headers of every request.
type scriptServer struct {
	mu       sync.Mutex
	statuses []int
	headers  []http.Header
}

func (s *scriptServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	n := len(s.headers)
	s.headers = append(s.headers, r.Header.Clone())
	st := s.statuses[min(n, len(s.statuses)-1)]
	s.mu.Unlock()
	w.WriteHeader(st)
}

func TestClientSpansOnePerAttemptChildOfTheCaller(t *testing.T) {
	tel := newTelemetry(t)
	srv := &scriptServer{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	opts := append(tel.options(), WithPropagators(propagation.TraceContext{}))
	tr := saferetry.NewTransport(nil, append(quick(), ClientOptions(opts...)...)...)

	ctx, parent := tel.tp.Tracer("test").Start(context.Background(), "caller")
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/pay?Signature=secret", strings.NewReader("x"))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	parent.End()

	key := srv.headers[0].Get("Idempotency-Key")
	require.NotEmpty(t, key)
	var attempts []trace.SpanContext
	for _, s := range tel.spans.Ended() {
		if s.Name() == "caller" {
			continue
		}
		attempts = append(attempts, s.SpanContext())
		assert.Equal(t, "POST", s.Name())
		assert.Equal(t, trace.SpanKindClient, s.SpanKind())
		assert.Equal(t, parent.SpanContext().SpanID(), s.Parent().SpanID(), "a child of the caller's span")
		assert.Equal(t, parent.SpanContext().TraceID(), s.SpanContext().TraceID())
		a := attrMap(s.Attributes())
		assert.Equal(t, keygen.Digest(key), a[KeyDigestKey].AsString())
		for _, kv := range s.Attributes() {
			assert.NotContains(t, kv.Value.String(), key, "never the raw key: %s", kv.Key)
			assert.NotContains(t, kv.Value.String(), "secret", "sensitive query redacted: %s", kv.Key)
		}
		assert.Equal(t, "POST", a[semconv.HTTPRequestMethodKey].AsString())
		assert.Equal(t, "127.0.0.1", a[semconv.ServerAddressKey].AsString())
	}
	require.Len(t, attempts, 2)
	ended := tel.spans.Ended()
	first, second := attrMap(ended[0].Attributes()), attrMap(ended[1].Attributes())
	assert.Equal(t, int64(503), first[semconv.HTTPResponseStatusCodeKey].AsInt64())
	assert.Equal(t, "status_503", first[AttemptClassKey].AsString())
	assert.Equal(t, "retry", first[AttemptOutcomeKey].AsString())
	assert.Equal(t, codes.Error, ended[0].Status().Code)
	_, resent := first[semconv.HTTPRequestResendCountKey]
	assert.False(t, resent, "the first attempt is no resend")
	assert.Equal(t, int64(1), second[semconv.HTTPRequestResendCountKey].AsInt64())
	assert.Equal(t, "status_503", second[RetryClassKey].AsString(), "the class the resend retries")
	assert.Equal(t, int64(200), second[semconv.HTTPResponseStatusCodeKey].AsInt64())
	assert.Equal(t, "final", second[AttemptOutcomeKey].AsString())
	assert.Equal(t, codes.Unset, ended[1].Status().Code)

	// Each attempt's traceparent names the attempt's own span.
	for i, h := range srv.headers {
		got := propagation.TraceContext{}.Extract(context.Background(), propagation.HeaderCarrier(h))
		assert.Equal(t, attempts[i].SpanID(), trace.SpanContextFromContext(got).SpanID(), "attempt %d", i+1)
	}
}

func TestClientMetrics(t *testing.T) {
	tel := newTelemetry(t)
	srv := &scriptServer{statuses: []int{503, 502, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := saferetry.NewTransport(nil, append(quick(), ClientOptions(tel.options()...)...)...)
	resp, err := tr.RoundTrip(mustGet(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()

	// A call that gives up: the only 14 tokens buy one retry, then the
	// budget says no.
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 14})
	tr = saferetry.NewTransport(nil, append(quick(saferetry.WithBudget(bucket)), ClientOptions(tel.options()...)...)...)
	_, err = tr.RoundTrip(mustGet(t, "http://"+closedAddr(t)+"/"))
	require.ErrorIs(t, err, retry.ErrExhausted)

	m := tel.collect(t)
	assert.Equal(t, map[string]int64{"status_503": 1, "status_502": 1, "ok": 1, "conn_refused": 2},
		counts(t, m[ClientAttempts], AttemptClassKey))
	assert.Equal(t, map[string]int64{"retry": 3, "final": 1, "stopped": 1},
		counts(t, m[ClientAttempts], AttemptOutcomeKey))
	assert.Equal(t, map[string]int64{"": 4, "budget_denied": 1}, counts(t, m[ClientAttempts], StopReasonKey),
		"a stop reason on stopped attempts only")
	assert.Equal(t, map[string]int64{"status_503": 1, "status_502": 1, "conn_refused": 1},
		counts(t, m[ClientRetries], RetryClassKey))
	assert.Equal(t, map[string]int64{"conn_refused": 1}, counts(t, m[ClientBudgetDenials], RetryClassKey))
	assert.Equal(t, map[string]int64{"budget_denied": 1}, counts(t, m[ClientExhausted], StopReasonKey))
	for _, key := range []attribute.Key{AttemptClassKey, AttemptOutcomeKey, StopReasonKey} {
		for label := range counts(t, m[ClientAttempts], key) {
			if label == "" {
				continue
			}
			assert.Regexp(t, `^[a-z0-9]+(_[a-z0-9]+)*$`, label, "%s is snake_case", key)
		}
	}

	wait := m[ClientRetryWait]
	assert.Equal(t, "s", wait.Unit)
	h, ok := wait.Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	var n uint64
	for _, dp := range h.DataPoints {
		n += dp.Count
		assert.Less(t, dp.Sum, 0.001, "microsecond waits, in seconds")
	}
	assert.Equal(t, uint64(3), n)
}

// A hedge's span and its attempt in the metrics carry
// saferetry.attempt.hedge=true, and no retry class (it retries nothing);
// the attempt that lost carries the outcome "lost" and no class (its
// outcome is never read).
func TestClientHedges(t *testing.T) {
	tel := newTelemetry(t)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Request-Attempt") == "1" {
			<-r.Context().Done() // the loser: canceled when the hedge wins
			return
		}
		w.WriteHeader(200)
	}))
	defer ts.Close()
	hedging := saferetry.WithHedging(saferetry.Hedging{Delay: 5 * time.Millisecond})
	tr := saferetry.NewTransport(nil, append(quick(hedging), ClientOptions(tel.options()...)...)...)
	resp, err := tr.RoundTrip(mustGet(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()

	byOutcome := map[string]map[attribute.Key]attribute.Value{}
	for _, s := range tel.spans.Ended() {
		a := attrMap(s.Attributes())
		byOutcome[a[AttemptOutcomeKey].AsString()] = a
	}
	require.Len(t, byOutcome, 2)
	hedge, lost := byOutcome["final"], byOutcome["lost"]
	assert.True(t, hedge[AttemptHedgeKey].AsBool())
	_, retrying := hedge[RetryClassKey]
	assert.False(t, retrying, "a hedge retries nothing")
	assert.Equal(t, int64(1), hedge[semconv.HTTPRequestResendCountKey].AsInt64())
	_, hedged := lost[AttemptHedgeKey]
	assert.False(t, hedged, "attempt 1 is no hedge")
	_, classified := lost[AttemptClassKey]
	assert.False(t, classified, "the loser's outcome is never read")

	m := tel.collect(t)
	assert.Equal(t, map[string]int64{"": 1, "true": 1}, counts(t, m[ClientAttempts], AttemptHedgeKey))
	assert.Equal(t, map[string]int64{"": 1, "ok": 1}, counts(t, m[ClientAttempts], AttemptClassKey))
	assert.Equal(t, map[string]int64{"lost": 1, "final": 1}, counts(t, m[ClientAttempts], AttemptOutcomeKey))
}

// Propagators that inject nothing leave the headers alone: the spans and
// metrics are still recorded.
func TestNoPropagatorInjectsNothing(t *testing.T) {
	tel := newTelemetry(t)
	srv := &scriptServer{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	opts := append(tel.options(), WithPropagators(propagation.NewCompositeTextMapPropagator()))
	tr := saferetry.NewTransport(nil, append(quick(), ClientOptions(opts...)...)...)
	resp, err := tr.RoundTrip(mustGet(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Empty(t, srv.headers[0].Get("Traceparent"))
	assert.Len(t, tel.spans.Ended(), 1)
}

func TestRedactedURL(t *testing.T) {
	req := mustGet(t, "https://user:pw@a.example:8443/p?Signature=s&x=1")
	assert.Equal(t, "https://REDACTED:REDACTED@a.example:8443/p?Signature=REDACTED&x=1", redactedURL(req.URL))
	assert.Equal(t, 8443, port(req.URL))
	assert.Equal(t, "_OTHER", methodAttr("BREW"))
	assert.Equal(t, "GET", methodAttr(""))
}

func mustGet(t *testing.T, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	return req
}

// closedAddr returns an address nothing listens on.
func closedAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	l.Close()
	return addr
}
