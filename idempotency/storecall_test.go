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

// countingStore is a memstore that counts every call of the Store,
// Transactor and Unit methods, by the Op that names it (a Unit's Commit is
// part of the write it commits).
type countingStore struct {
	*memstore.Store
	mu    sync.Mutex
	calls map[idempotency.Op]int
}

func (s *countingStore) count(op idempotency.Op) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.calls == nil {
		s.calls = map[idempotency.Op]int{}
	}
	s.calls[op]++
}

func (s *countingStore) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	s.count(idempotency.OpClaim)
	return s.Store.Claim(ctx, c)
}

func (s *countingStore) Get(ctx context.Context, sc idempotency.Scope) (idempotency.Record, error) {
	s.count(idempotency.OpGet)
	return s.Store.Get(ctx, sc)
}

// Heartbeat counts a heartbeat to now (the tests run in a synctest bubble,
// whose clock stands still during a call) as the end of a lease.
func (s *countingStore) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	if until.After(time.Now()) {
		s.count(idempotency.OpHeartbeat)
	} else {
		s.count(idempotency.OpEndLease)
	}
	return s.Store.Heartbeat(ctx, l, until)
}

func (s *countingStore) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	s.count(idempotency.OpComplete)
	return s.Store.Complete(ctx, l, resp, now)
}

func (s *countingStore) Release(ctx context.Context, l idempotency.Lease) error {
	s.count(idempotency.OpRelease)
	return s.Store.Release(ctx, l)
}

func (s *countingStore) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string, data []byte,
	now time.Time) error {
	s.count(idempotency.OpSetRecoveryPoint)
	return s.Store.SetRecoveryPoint(ctx, l, point, data, now)
}

func (s *countingStore) Abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	s.count(idempotency.OpAbandoned)
	return s.Store.Abandoned(ctx, now, limit)
}

func (s *countingStore) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	s.count(idempotency.OpDeleteBefore)
	return s.Store.DeleteBefore(ctx, horizon, limit)
}

func (s *countingStore) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit, context.Context, error) {
	s.count(idempotency.OpBegin)
	u, uctx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, uctx, err
	}
	return &countingUnit{Unit: u, s: s}, uctx, nil
}

type countingUnit struct {
	idempotency.Unit
	s *countingStore
}

func (u *countingUnit) SetRecoveryPoint(ctx context.Context, point string, data []byte, now time.Time) error {
	u.s.count(idempotency.OpSetRecoveryPoint)
	return u.Unit.SetRecoveryPoint(ctx, point, data, now)
}

func (u *countingUnit) Complete(ctx context.Context, resp idempotency.Response, now time.Time) error {
	u.s.count(idempotency.OpComplete)
	return u.Unit.Complete(ctx, resp, now)
}

func (u *countingUnit) Rollback() error {
	u.s.count(idempotency.OpRollback)
	return u.Unit.Rollback()
}

// Every store call that the middleware, its Completer and its Reaper make
// reaches Observer.StoreCall, with its own Op: the claim, the reads of a
// request waiting on a key in progress and of the give-up, the heartbeats,
// the units begun, committed and rolled back by phases and by the request,
// the recovery points of External, the completion, the release, the end
// of a lease kept for a resume, and the jobs' listings and deletes.
func TestEveryStoreCallReachesTheObserver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &countingStore{Store: memstore.New()}
		var mu sync.Mutex
		seenOps := map[idempotency.Op]int{}
		obs := idempotency.Observer{StoreCall: func(_ context.Context, e idempotency.Event) {
			mu.Lock()
			defer mu.Unlock()
			seenOps[e.Op]++
		}}
		boom := errors.New("out of stock")
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			run, _ := idempotency.FromContext(ctx)
			switch run.Scope.Key {
			case "slow":
				time.Sleep(time.Minute) // heartbeats; a duplicate waits on it meanwhile
				w.WriteHeader(http.StatusCreated)
			case "phases":
				_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) { return []byte("o"), nil })
				require.NoError(t, err)
				_, err = run.Phase(ctx, "reserve", func(context.Context) ([]byte, error) { return nil, boom })
				require.ErrorIs(t, err, boom)
				_, err = run.External(ctx, "charge", func(context.Context, string) ([]byte, error) {
					return []byte("ch"), nil
				}, nil)
				require.NoError(t, err)
				_, _, err = run.Unit(ctx)
				require.NoError(t, err)
				w.WriteHeader(http.StatusCreated)
			case "kept":
				_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) { return []byte("o"), nil })
				require.NoError(t, err)
				w.WriteHeader(http.StatusInternalServerError) // kept for a resume: its lease ended
			default:
				w.WriteHeader(http.StatusServiceUnavailable) // released
			}
		})
		mw := idempotency.New(store, idempotency.WithLogger(quiet), idempotency.WithAnonymousKeys(true),
			idempotency.WithMaxInProgressWait(time.Hour), idempotency.WithLease(30*time.Second),
			idempotency.WithObserver(obs))
		g := mw.Wrap(h)
		slow := make(chan int)
		go func() { slow <- send(t, g, "slow", `{}`).Code }()
		synctest.Wait()
		dup := make(chan int)
		go func() { dup <- send(t, g, "slow", `{}`).Code }()
		require.Equal(t, http.StatusCreated, <-slow)
		require.Equal(t, http.StatusCreated, <-dup)
		require.Equal(t, http.StatusCreated, send(t, g, "phases", `{}`).Code)
		require.Equal(t, http.StatusInternalServerError, send(t, g, "kept", `{}`).Code)
		require.Equal(t, http.StatusServiceUnavailable, send(t, g, "released", `{}`).Code)

		time.Sleep(time.Second)
		rep, err := mw.Completer(map[string]http.Handler{"/payments": h}).RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Kept, "the kept record resumed and was kept again: %+v", rep)
		_, err = mw.Reaper().ReapOnce(t.Context(), time.Now().Add(1000*time.Hour))
		require.NoError(t, err)
		synctest.Wait()

		store.mu.Lock()
		defer store.mu.Unlock()
		mu.Lock()
		defer mu.Unlock()
		for _, op := range []idempotency.Op{
			idempotency.OpClaim, idempotency.OpGet, idempotency.OpHeartbeat, idempotency.OpEndLease,
			idempotency.OpComplete, idempotency.OpRelease, idempotency.OpSetRecoveryPoint,
			idempotency.OpBegin, idempotency.OpRollback, idempotency.OpAbandoned, idempotency.OpDeleteBefore,
		} {
			require.Positive(t, store.calls[op], "the scenario makes %s calls", op)
		}
		require.Equal(t, store.calls, seenOps, "store calls made, by Op, and those the observer saw")
	})
}
