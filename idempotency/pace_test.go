package idempotency_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// timedStore is a memory store whose DeleteBefore takes took (in the
// bubble's time) and records when each call started and ended.
type timedStore struct {
	*memstore.Store
	took  time.Duration
	mu    sync.Mutex
	calls [][2]time.Time
}

func (s *timedStore) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	start := time.Now()
	time.Sleep(s.took)
	n, err := s.Store.DeleteBefore(ctx, horizon, limit)
	s.mu.Lock()
	s.calls = append(s.calls, [2]time.Time{start, time.Now()})
	s.mu.Unlock()
	return n, err
}

// The Reaper yields to live traffic: after each full batch it waits as long
// as the batch took before it starts the next, and it does not wait after
// the last one. Three full batches of 100 and a last empty one, each taking
// 40 ms, take 160 ms of deletes and 120 ms of pauses.
func TestReaperYieldsAsLongAsEachBatchTook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &timedStore{Store: memstore.New(), took: 40 * time.Millisecond}
		t0 := time.Now()
		for i := range 300 {
			seed(t, s, fmt.Sprint("k", i), t0, true)
		}
		time.Sleep(100 * time.Hour)
		m := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet))
		start := time.Now()
		rep, err := m.Reaper().ReapOnce(t.Context(), time.Now())
		require.NoError(t, err)
		require.Equal(t, 300, rep.Deleted)
		require.Len(t, s.calls, 4)
		for i := 1; i < len(s.calls); i++ {
			prev := s.calls[i-1]
			require.Equal(t, prev[1].Sub(prev[0]), s.calls[i][0].Sub(prev[1]), "pause before batch %d", i)
		}
		require.Equal(t, 280*time.Millisecond, time.Since(start))

		// Its end is seen between batches: a run canceled during a pause
		// returns at once.
		for i := range 300 {
			seed(t, s, fmt.Sprint("again", i), time.Now(), true)
		}
		time.Sleep(100 * time.Hour)
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		start = time.Now()
		rep, err = m.Reaper().ReapOnce(ctx, time.Now())
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, 100, rep.Deleted, "one batch, then the pause that the deadline cut")
		require.Equal(t, 50*time.Millisecond, time.Since(start))
	})
}

// The Completer yields to live traffic: after each record it resumed it
// waits as long as that record took before it takes over the next. Three
// abandoned records whose handler takes 30 ms run 30 ms apart.
func TestCompleterYieldsAsLongAsEachRecordTook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := memstore.New()
		const route = "POST /orders"
		for i := range 3 {
			sc := idempotency.Scope{Method: "POST", Route: route, Key: fmt.Sprint("order-", i)}
			body := []byte(`{"amount":1}`)
			_, err := s.Claim(t.Context(), idempotency.Claim{
				Scope: sc,
				Fingerprint: idempotency.Fingerprint(idempotency.FingerprintVersion, "POST", route, "/orders", "",
					"application/json", body),
				FingerprintVersion: idempotency.FingerprintVersion,
				Owner:              "dead-owner",
				Request: idempotency.StoredRequest("POST", "/orders", "shop.example",
					"application/json", body),
				Now: time.Now(), LeaseFor: 30 * time.Second, ReplayWindow: 24 * time.Hour,
			})
			require.NoError(t, err)
		}
		time.Sleep(time.Minute)
		var runs [][2]time.Time
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			start := time.Now()
			time.Sleep(30 * time.Millisecond)
			w.WriteHeader(http.StatusCreated)
			runs = append(runs, [2]time.Time{start, time.Now()})
		})
		m := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet))
		rep, err := m.Completer(map[string]http.Handler{route: h}).RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 3, rep.Completed)
		require.Len(t, runs, 3)
		for i := 1; i < len(runs); i++ {
			require.Equal(t, 30*time.Millisecond, runs[i][0].Sub(runs[i-1][1]), "pause before record %d", i)
		}
	})
}
