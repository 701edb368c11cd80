package sqlstore_test

import (
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// On SQLite and PostgreSQL, every duration option at its longest value, and
// at a value where the replay window plus the lease overflows, means
// (about) forever: a request completes, the Reaper run 100 h later deletes
// nothing, its horizon lies centuries back, and the retry gets the replay.
func TestDurationsSaturateSQL(t *testing.T) {
	limits := []struct {
		name string
		opt  idempotency.Option
	}{
		{"replay window max", idempotency.WithReplayWindow(math.MaxInt64)},
		{"replay window plus lease overflows", idempotency.WithReplayWindow(math.MaxInt64 - 10*time.Second)},
		{"lease max", idempotency.WithLease(math.MaxInt64)},
		{"lease plus window overflows", idempotency.WithLease(math.MaxInt64 - 12*time.Hour)},
		{"cleanup horizon max", idempotency.WithCleanupHorizon(math.MaxInt64)},
	}
	forEach(t, func(t *testing.T, b backend) {
		for _, tc := range limits {
			t.Run(tc.name, func(t *testing.T) {
				s, db := newStore(t, b)
				mw := idempotency.New(s, idempotency.WithAnonymousKeys(true), tc.opt,
					idempotency.WithLogger(slog.New(slog.DiscardHandler)))
				runs := 0
				srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs++
					w.WriteHeader(http.StatusCreated)
					w.Write([]byte("paid"))
				})))
				t.Cleanup(srv.Close)
				first := post(t, srv, "", "k-forever", "pay")
				require.Equal(t, http.StatusCreated, first.status)
				now := time.Now()
				rep, err := mw.Reaper().ReapOnce(t.Context(), now.Add(100*time.Hour))
				require.NoError(t, err)
				require.Zero(t, rep.Deleted)
				require.True(t, rep.Horizon.Before(now.Add(-100*365*24*time.Hour)), "horizon %v", rep.Horizon)
				require.Equal(t, 1, countRecords(t, db, "k-forever"), "the record is kept")
				again := post(t, srv, "", "k-forever", "pay")
				require.True(t, again.replayed)
				require.Equal(t, 1, runs)
			})
		}
	})
}
