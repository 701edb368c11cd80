package otelsaferetry

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

var quietLog = slog.New(slog.DiscardHandler)

func send(t *testing.T, h http.Handler, key, body string) int {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code
}

func TestServerMetrics(t *testing.T) {
	tel := newTelemetry(t)
	obs := ServerObserver(tel.options()...)
	store := memstore.New()
	entered, release := make(chan struct{}), make(chan struct{})
	h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quietLog), idempotency.WithObserver(obs),
		idempotency.WithMaxInProgressWait(0)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if string(b) == "slow" {
			close(entered)
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))

	require.Equal(t, http.StatusCreated, send(t, h, "a", "x"))
	require.Equal(t, http.StatusCreated, send(t, h, "a", "x"))             // replay
	require.Equal(t, http.StatusUnprocessableEntity, send(t, h, "a", "y")) // key reused
	done := make(chan int)
	go func() { done <- send(t, h, "b", "slow") }()
	<-entered
	require.Equal(t, http.StatusConflict, send(t, h, "b", "slow")) // in progress
	close(release)
	require.Equal(t, http.StatusCreated, <-done)

	// A store that fails: 503, one store error.
	failing := idempotency.New(failStore{}, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quietLog), idempotency.WithObserver(obs)).Wrap(http.NotFoundHandler())
	require.Equal(t, http.StatusServiceUnavailable, send(t, failing, "c", "x"))

	// The reaper finds one record in progress for 100 hours.
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	res, err := store.Claim(t.Context(), idempotency.Claim{
		Scope: idempotency.Scope{Method: http.MethodPost, Route: "/stuck", Key: "d"}, Owner: "crashed",
		Now: t0, LeaseFor: time.Second, Fingerprint: "fp", FingerprintVersion: 1,
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	_, err = idempotency.New(store, idempotency.WithLogger(quietLog), idempotency.WithObserver(obs)).Reaper().
		ReapOnce(t.Context(), t0.Add(100*time.Hour))
	require.NoError(t, err)

	m := tel.collect(t)
	assert.Equal(t, map[string]int64{"completed": 2}, counts(t, m[ServerExecutions], ExecutionOutcomeKey))
	assert.Equal(t, map[string]int64{"POST": 1}, counts(t, m[ServerReplays], "http.request.method"))
	assert.Equal(t, map[string]int64{string(idempotency.CodeKeyReused): 1, string(idempotency.CodeInProgress): 1,
		string(idempotency.CodeStoreUnavailable): 1},
		counts(t, m[ServerRefusals], ProblemCodeKey))
	assert.Equal(t, map[string]int64{"422": 1, "409": 1, "503": 1}, counts(t, m[ServerRefusals], "http.response.status_code"))
	assert.Equal(t, map[string]int64{"claim": 1, "get": 1}, counts(t, m[ServerStoreErrors], StoreOperationKey),
		"the failed claim, and the read that tells whether it applied")

	lat, ok := m[ServerStoreDuration].Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	ops := map[string]uint64{}
	for _, dp := range lat.DataPoints {
		v, _ := dp.Attributes.Value(StoreOperationKey)
		ops[v.AsString()] += dp.Count
	}
	assert.Equal(t, uint64(6), ops["claim"], "every claim is timed, the failed one included")
	assert.Equal(t, uint64(2), ops["complete"])

	age, ok := m[ServerUnfinishedAge].Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	require.Len(t, age.DataPoints, 1)
	assert.Equal(t, uint64(1), age.DataPoints[0].Count)
	assert.InDelta(t, (100 * time.Hour).Seconds(), age.DataPoints[0].Sum, 1)
}

// Behind deadline.Middleware, the executions and refusals say whether the
// request was a retry or a first try; a request that carried no attempt
// number has no such attribute.
func TestServerMetricsTellRetriesFromFirstTries(t *testing.T) {
	tel := newTelemetry(t)
	h := deadline.Middleware(idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true),
		idempotency.WithLogger(quietLog), idempotency.WithObserver(ServerObserver(tel.options()...))).Wrap(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })))
	for _, c := range []struct{ key, attempt, body string }{
		{"a", "1", "x"}, {"b", "2", "x"}, {"c", "", "x"}, {"a", "3", "y"}, // the last one: key reused
	} {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(c.body))
		req.Header.Set("Idempotency-Key", c.key)
		if c.attempt != "" {
			req.Header.Set("Request-Attempt", c.attempt)
		}
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	m := tel.collect(t)
	assert.Equal(t, map[string]int64{"false": 1, "true": 1, "": 1}, counts(t, m[ServerExecutions], RequestRetryKey))
	assert.Equal(t, map[string]int64{"true": 1}, counts(t, m[ServerRefusals], RequestRetryKey))
}

// failStore fails every call.
type failStore struct{ idempotency.Store }

var errDown = errors.New("store down")

func (failStore) Claim(context.Context, idempotency.Claim) (idempotency.ClaimResult, error) {
	return idempotency.ClaimResult{}, errDown
}

// Get fails too: the read that tells whether a failed claim applied.
func (failStore) Get(context.Context, idempotency.Scope) (idempotency.Record, error) {
	return idempotency.Record{}, errDown
}

// A record kept for a resume (a phase committed, then a 503) is taken over
// by the retry: one takeover.
func TestServerTakeoverMetric(t *testing.T) {
	tel := newTelemetry(t)
	var calls atomic.Int64
	h := idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quietLog),
		idempotency.WithObserver(ServerObserver(tel.options()...))).Wrap(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				run, _ := idempotency.FromContext(r.Context())
				_, err := run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return nil, nil })
				require.NoError(t, err)
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
	require.Equal(t, http.StatusServiceUnavailable, send(t, h, "k", "x"))
	time.Sleep(time.Millisecond) // the lease ended at once; it is expired after that instant
	require.Equal(t, http.StatusCreated, send(t, h, "k", "x"))
	assert.Equal(t, map[string]int64{"POST": 1}, counts(t, tel.collect(t)[ServerTakeovers], "http.request.method"))
}
