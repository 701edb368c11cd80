package otelsaferetry

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/saferetry/saferetry/idempotency"
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
	store := idempotency.NewMemoryStore()
	entered, release := make(chan struct{}), make(chan struct{})
	h := idempotency.New(store, idempotency.WithAnonymousKeys(), idempotency.WithLogger(quietLog), idempotency.WithObserver(obs),
		idempotency.WithInProgressWait(0))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
	failing := idempotency.New(failStore{}, idempotency.WithAnonymousKeys(), idempotency.WithLogger(quietLog), idempotency.WithObserver(obs))(http.NotFoundHandler())
	require.Equal(t, http.StatusServiceUnavailable, send(t, failing, "c", "x"))

	// The reaper finds one record in progress for 100 hours.
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	_, ok, err := claimed(store.Claim(t.Context(), idempotency.Claim{
		Scope: idempotency.Scope{Method: http.MethodPost, Route: "/stuck", Key: "d"}, Owner: "crashed",
		Now: t0, LeaseFor: time.Second, Fingerprint: "fp", FingerprintVersion: 1,
	}))
	require.NoError(t, err)
	require.True(t, ok)
	_, err = idempotency.NewReaper(store, idempotency.ReaperConfig{Logger: quietLog, Observer: obs}).
		ReapOnce(t.Context(), t0.Add(100*time.Hour))
	require.NoError(t, err)

	m := tel.collect(t)
	assert.Equal(t, map[string]int64{idempotency.OutcomeCompleted: 2}, counts(t, m[ServerExecutions], ExecutionOutcomeKey))
	assert.Equal(t, map[string]int64{"POST": 1}, counts(t, m[ServerReplays], "http.request.method"))
	assert.Equal(t, map[string]int64{idempotency.CodeKeyReused: 1, idempotency.CodeInProgress: 1},
		counts(t, m[ServerConflicts], ProblemCodeKey))
	assert.Equal(t, map[string]int64{"422": 1, "409": 1}, counts(t, m[ServerConflicts], "http.response.status_code"))
	assert.Equal(t, map[string]int64{idempotency.OpClaim: 1}, counts(t, m[ServerStoreErrors], StoreOperationKey))

	lat, ok := m[ServerStoreDuration].Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	ops := map[string]uint64{}
	for _, dp := range lat.DataPoints {
		v, _ := dp.Attributes.Value(StoreOperationKey)
		ops[v.AsString()] += dp.Count
	}
	assert.Equal(t, uint64(6), ops[idempotency.OpClaim], "every claim is timed, the failed one included")
	assert.Equal(t, uint64(2), ops[idempotency.OpComplete])

	age, ok := m[ServerUnfinishedAge].Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	require.Len(t, age.DataPoints, 1)
	assert.Equal(t, uint64(1), age.DataPoints[0].Count)
	assert.InDelta(t, (100 * time.Hour).Seconds(), age.DataPoints[0].Sum, 1)
}

// failStore fails every call.
type failStore struct{ idempotency.Store }

var errDown = errors.New("store down")

func (failStore) Claim(context.Context, idempotency.Claim) (idempotency.ClaimResult, error) {
	return idempotency.ClaimResult{}, errDown
}

func TestServerTakeoverMetric(t *testing.T) {
	tel := newTelemetry(t)
	store := idempotency.NewMemoryStore()
	body := "x"
	_, ok, err := claimed(store.Claim(t.Context(), idempotency.Claim{
		Scope: idempotency.Scope{Method: http.MethodPost, Route: "/payments", Key: "k"}, Owner: "crashed",
		Now: time.Now().Add(-time.Hour), LeaseFor: time.Second, FingerprintVersion: idempotency.FingerprintVersion,
		Fingerprint: idempotency.Fingerprint(http.MethodPost, "/payments", "/payments", "", "application/json", []byte(body)),
	}))
	require.NoError(t, err)
	require.True(t, ok)
	h := idempotency.New(store, idempotency.WithAnonymousKeys(), idempotency.WithLogger(quietLog), idempotency.WithObserver(ServerObserver(tel.options()...)))(
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) }))
	require.Equal(t, http.StatusCreated, send(t, h, "k", body))
	assert.Equal(t, map[string]int64{"POST": 1}, counts(t, tel.collect(t)[ServerTakeovers], "http.request.method"))
}

// claimed unpacks a Claim's result as (record, acquired, error).
func claimed(res idempotency.ClaimResult, err error) (idempotency.Record, bool, error) {
	return res.Record, res.Acquired(), err
}
