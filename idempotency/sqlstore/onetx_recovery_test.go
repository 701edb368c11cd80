package sqlstore_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// A route switched to WithOneTransaction while one of its requests was in
// progress, multi-step, with a committed phase: the retry takes the record
// over the ordinary way, and its phases run as on any takeover (the
// committed one is skipped, the next runs), so the record completes
// instead of being refused forever. A fresh key on that route is claimed
// in one transaction, and a phase there fails with ErrOneTransaction.
func TestOneTransactionResumesAnOldMultiStepRecord(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		var firstRuns, secondRuns atomic.Int64
		var refused atomic.Int64
		handler := func(fail bool) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				if _, err := run.Phase(r.Context(), "reserve", func(context.Context) ([]byte, error) {
					firstRuns.Add(1)
					return nil, nil
				}); err != nil {
					if errors.Is(err, idempotency.ErrOneTransaction) {
						refused.Add(1)
					}
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				if fail {
					http.Error(w, "down", http.StatusInternalServerError)
					return
				}
				if _, err := run.Phase(r.Context(), "confirm", func(context.Context) ([]byte, error) {
					secondRuns.Add(1)
					return nil, nil
				}); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}
		}
		serve := func(oneTx, fail bool) *httptest.Server {
			mw := idempotency.New(s, idempotency.WithOneTransaction(oneTx),
				idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }),
				idempotency.WithLogger(nil))
			mux := http.NewServeMux()
			mux.Handle("POST /orders", mw.Wrap(handler(fail)))
			srv := httptest.NewServer(mux)
			t.Cleanup(srv.Close)
			return srv
		}

		before := oneTxPost(t, serve(false, true), "", "old")
		require.Equal(t, http.StatusInternalServerError, before.status, before.body)
		rec, err := s.Get(t.Context(), idempotency.Scope{Principal: "acct_1", Method: "POST",
			Route: "POST /orders", Key: "old"})
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, rec.State)
		require.Equal(t, "reserve", rec.RecoveryPoint)

		after := serve(true, false)
		resumed := oneTxPost(t, after, "", "old")
		require.Equal(t, http.StatusCreated, resumed.status, resumed.body)
		require.EqualValues(t, [2]int64{1, 1}, [2]int64{firstRuns.Load(), secondRuns.Load()},
			"the committed phase is skipped, the next runs once")
		replay := oneTxPost(t, after, "", "old")
		require.Equal(t, http.StatusCreated, replay.status)
		require.True(t, replay.replayed)

		fresh := oneTxPost(t, after, "", "new")
		require.Equal(t, http.StatusInternalServerError, fresh.status, fresh.body)
		require.EqualValues(t, 1, refused.Load(), "a phase in one transaction is refused")
		_, err = s.Get(t.Context(), idempotency.Scope{Principal: "acct_1", Method: "POST",
			Route: "POST /orders", Key: "new"})
		require.ErrorIs(t, err, idempotency.ErrNotFound, "the refused request left nothing")
	})
}
