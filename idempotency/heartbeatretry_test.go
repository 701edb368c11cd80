package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// errHang makes a try of scriptedBeats hang until its context ends.
var errHang = errors.New("hang")

// scriptedBeats is a memstore.Store whose heartbeat tries, numbered from
// 1, go as answer says: nil passes the try to the store, errHang holds it
// until its context ends, another error fails it at once. It records each
// try's start and end, from start.
type scriptedBeats struct {
	*memstore.Store
	start  time.Time
	answer func(n int) error
	mu     sync.Mutex
	tries  []beatTry
}

type beatTry struct {
	start, end time.Duration
	err        error
}

func (s *scriptedBeats) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	s.mu.Lock()
	n := len(s.tries)
	s.tries = append(s.tries, beatTry{start: time.Since(s.start)})
	s.mu.Unlock()
	err := s.answer(n + 1)
	switch {
	case errors.Is(err, errHang):
		<-ctx.Done()
		err = ctx.Err()
	case err == nil:
		err = s.Store.Heartbeat(ctx, l, until)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tries[n].end, s.tries[n].err = time.Since(s.start), err
	return err
}

func (s *scriptedBeats) taken() []beatTry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]beatTry(nil), s.tries...)
}

// longRun is what became of a handler that works for hold unless its
// context is canceled first.
type longRun struct {
	status     int
	cause      error         // its context's cause, when canceled
	canceledAt time.Duration // from the start
}

// runLong serves one request whose handler works for hold through the
// middleware over store, with a lease of 30 s, in the bubble of the
// caller, and returns what became of it.
func runLong(t *testing.T, store idempotency.Store, hold time.Duration) longRun {
	t.Helper()
	start := time.Now()
	var r longRun
	h := idempotency.New(store, idempotency.WithAnonymousKeys(true),
		idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).
		Wrap(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			select {
			case <-time.After(hold):
				w.WriteHeader(http.StatusCreated)
			case <-req.Context().Done():
				r.cause, r.canceledAt = context.Cause(req.Context()), time.Since(start)
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
	r.status = send(t, h, "k", `{}`).Code
	return r
}

// A heartbeat try that fails without an answer of the store's (a dead
// pooled connection) is tried again 20 ms later, on a fresh connection:
// the handler runs on, beats keep their fixed rate of lease/3, and the
// request completes. testing/synctest provides the fake time.
func TestHeartbeatRetriesAFailedTry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &scriptedBeats{Store: memstore.New(), start: time.Now(),
			answer: func(n int) error {
				if n%2 == 1 {
					return errBoom // every beat's first try
				}
				return nil
			}}
		r := runLong(t, store, 95*time.Second)
		require.Equal(t, http.StatusCreated, r.status)
		require.NoError(t, r.cause)
		var starts []time.Duration
		for _, try := range store.taken() {
			starts = append(starts, try.start)
		}
		var want []time.Duration
		for beat := 10 * time.Second; beat < 95*time.Second; beat += 10 * time.Second {
			want = append(want, beat, beat+20*time.Millisecond)
		}
		require.Equal(t, want, starts)
	})
}

// The store's ErrLeaseLost is an answer: the handler's context is canceled
// at once with that cause (not the expiry's), and the beat is not tried
// again. testing/synctest provides the fake time.
func TestHeartbeatLeaseLostStopsTheHandlerAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &scriptedBeats{Store: memstore.New(), start: time.Now(),
			answer: func(int) error { return idempotency.ErrLeaseLost }}
		r := runLong(t, store, 95*time.Second)
		require.ErrorIs(t, r.cause, idempotency.ErrLeaseLost)
		require.NotErrorIs(t, r.cause, idempotency.ErrLeaseExpired)
		require.Equal(t, 10*time.Second, r.canceledAt, "at the first beat")
		require.Len(t, store.taken(), 1, "an answer is not tried again")
	})
}

// Tries that keep failing, or hang, go on until a sixth of the lease is
// left (25 s of a 30 s lease claimed at 0): then, and not later, the
// handler's context is canceled with a cause that wraps ErrLeaseLost and
// the store's error, and no try runs past that bound. testing/synctest
// provides the fake time.
func TestHeartbeatTriesStopTheHandlerAtTheBound(t *testing.T) {
	for name, answer := range map[string]error{"failing": errBoom, "hanging": errHang} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := &scriptedBeats{Store: memstore.New(), start: time.Now(),
					answer: func(int) error { return answer }}
				r := runLong(t, store, 95*time.Second)
				const bound = 25 * time.Second
				require.Equal(t, bound, r.canceledAt)
				require.ErrorIs(t, r.cause, idempotency.ErrLeaseExpired)
				require.ErrorIs(t, r.cause, idempotency.ErrLeaseLost)
				tries := store.taken()
				require.Equal(t, 10*time.Second, tries[0].start, "the first beat")
				for _, try := range tries {
					require.LessOrEqual(t, try.end, bound, "a try past the bound")
				}
				last := tries[len(tries)-1]
				if answer == errBoom {
					require.ErrorIs(t, r.cause, errBoom)
					require.Greater(t, len(tries), 10, "tried again")
					require.Greater(t, last.start, bound-time.Second, "the tries went on until the bound")
				} else {
					require.Equal(t, bound, last.end, "the hanging try was cut at the bound")
				}
			})
		})
	}
}

// slowClaim is a memstore.Store whose claims take 4 s.
type slowClaim struct{ *scriptedBeats }

func (s slowClaim) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	time.Sleep(4 * time.Second)
	return s.scriptedBeats.Claim(ctx, c)
}

// The lease a claim holds counts from before its round trip: the first
// beat comes when 2/3 of that lease is left (10 s of 30 s after the
// claim's start), as every later beat does, not a third of the lease after
// the claim returned. testing/synctest provides the fake time.
func TestHeartbeatFirstBeatCountsFromTheClaim(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &scriptedBeats{Store: memstore.New(), start: time.Now(),
			answer: func(int) error { return nil }}
		r := runLong(t, slowClaim{store}, 25*time.Second)
		require.Equal(t, http.StatusCreated, r.status)
		var starts []time.Duration
		for _, try := range store.taken() {
			starts = append(starts, try.start)
		}
		require.Equal(t, []time.Duration{10 * time.Second, 20 * time.Second}, starts)
	})
}
