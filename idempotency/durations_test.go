package idempotency_test

import (
	"math"
	"net/http"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// durationLimits are the duration options at their longest value, and at
// a value where the window plus the lease overflows: each means forever,
// or about as long, and never wraps around to a short horizon.
var durationLimits = []struct {
	name   string
	opt    idempotency.Option
	window bool // the replay window is the long one
}{
	{"replay window max", idempotency.WithReplayWindow(math.MaxInt64), true},
	{"replay window plus lease overflows", idempotency.WithReplayWindow(math.MaxInt64 - 10*time.Second), true},
	{"lease max", idempotency.WithLease(math.MaxInt64), false},
	{"lease plus window overflows", idempotency.WithLease(math.MaxInt64 - 12*time.Hour), false},
	{"cleanup horizon max", idempotency.WithCleanupHorizon(math.MaxInt64), false},
}

// Every sum of configured durations saturates. "Replay forever"
// (WithReplayWindow(math.MaxInt64)), a lease as long, a horizon as long:
// a request completes, the Reaper run 100 h later deletes nothing, its
// horizon lies centuries back, and under the long window the retry 100 h
// later gets the replay.
func TestDurationsSaturate(t *testing.T) {
	for _, tc := range durationLimits {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := memstore.New()
				h := &payments{}
				mw := idempotency.New(store, idempotency.WithLogger(quiet), idempotency.WithAnonymousKeys(true),
					tc.opt)
				g := mw.Wrap(h)
				start := time.Now()
				first := send(t, g, "k", `{}`)
				require.Equal(t, http.StatusCreated, first.Code)
				rep, err := mw.Reaper().ReapOnce(t.Context(), start.Add(100*time.Hour))
				require.NoError(t, err)
				require.Zero(t, rep.Deleted)
				require.True(t, rep.Horizon.Before(start.Add(-100*365*24*time.Hour)), "horizon %v", rep.Horizon)
				_, err = store.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
				require.NoError(t, err, "the record is kept")
				if !tc.window {
					return
				}
				time.Sleep(100 * time.Hour)
				again := send(t, g, "k", `{}`)
				require.Equal(t, "true", again.Header().Get(idempotency.ReplayedHeader), "%d %s", again.Code,
					again.Body)
				require.Equal(t, first.Body.String(), again.Body.String())
				require.EqualValues(t, 1, h.n.Load())
			})
		})
	}
}

// A request waiting on a key in progress with WithMaxInProgressWait at its
// longest waits for it to finish and gets the replay.
func TestLongestInProgressWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		var runs atomic.Int32
		g := idempotency.New(memstore.New(), idempotency.WithLogger(quiet), idempotency.WithAnonymousKeys(true),
			idempotency.WithMaxInProgressWait(math.MaxInt64)).
			Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				<-release
				w.WriteHeader(http.StatusCreated)
				w.Write([]byte("paid"))
			}))
		first := make(chan int)
		go func() { first <- send(t, g, "k", `{}`).Code }()
		synctest.Wait()
		dup := make(chan string)
		go func() {
			a := send(t, g, "k", `{}`)
			dup <- a.Header().Get(idempotency.ReplayedHeader) + " " + a.Body.String()
		}()
		time.Sleep(time.Hour)
		synctest.Wait()
		close(release)
		require.Equal(t, http.StatusCreated, <-first)
		require.Equal(t, "true paid", <-dup)
		require.EqualValues(t, 1, runs.Load())
	})
}
