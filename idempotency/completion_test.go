package idempotency_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// lostCompletion is a memstore whose first Store.Complete fails: before
// it writes anything (lost connection) or, with applied, after it wrote
// (the answer lost on its way back).
type lostCompletion struct {
	*memstore.Store
	applied bool
	calls   atomic.Int32
}

func (s *lostCompletion) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	if s.calls.Add(1) > 1 {
		return s.Store.Complete(ctx, l, resp, now)
	}
	if s.applied {
		if err := s.Store.Complete(ctx, l, resp, now); err != nil {
			return err
		}
	}
	return errStore
}

// A completion that fails is tried again: it is fenced by owner and
// generation, so a repeat is safe. When the first try had applied, the
// repeat finds the record no longer in progress, and the record, completed
// by this owner and generation, says it was this completion. Either way
// the client gets its first answer, the execution ended completed, and a
// retry gets the replay.
func TestCompletionIsTriedAgain(t *testing.T) {
	for _, applied := range []bool{false, true} {
		t.Run(map[bool]string{false: "not applied", true: "applied, answer lost"}[applied], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := &lostCompletion{Store: memstore.New(), applied: applied}
				s := &seen{}
				h := &payments{}
				g := idempotency.New(store, idempotency.WithLogger(quiet), idempotency.WithAnonymousKeys(true),
					idempotency.WithObserver(s.observer())).Wrap(h)
				first := send(t, g, "k", `{}`)
				require.Equal(t, http.StatusCreated, first.Code)
				require.Empty(t, first.Header().Get(idempotency.ReplayedHeader))
				require.EqualValues(t, 2, store.calls.Load())
				_, by := s.take()
				require.Equal(t, idempotency.OutcomeCompleted, by["executed"][0].Outcome)
				require.NoError(t, by["executed"][0].Err)
				again := send(t, g, "k", `{}`)
				require.Equal(t, "true", again.Header().Get(idempotency.ReplayedHeader))
				require.Equal(t, first.Body.String(), again.Body.String())
				require.EqualValues(t, 1, h.n.Load())
			})
		})
	}
}

// unreadCommit is a memstore whose units' first Commit applies, then fails
// (the answer lost with its connection), and whose Gets then fail for
// unreadable (the store unreachable) before it answers again.
type unreadCommit struct {
	*memstore.Store
	unreadable time.Duration
	back       atomic.Pointer[time.Time] // when Gets work again, once the commit failed
}

func (s *unreadCommit) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit,
	context.Context, error) {
	u, uctx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, uctx, err
	}
	return &lostCommitUnit{Unit: u, s: s}, uctx, nil
}

func (s *unreadCommit) Get(ctx context.Context, sc idempotency.Scope) (idempotency.Record, error) {
	if back := s.back.Load(); back != nil && time.Now().Before(*back) {
		return idempotency.Record{}, errStore
	}
	return s.Store.Get(ctx, sc)
}

type lostCommitUnit struct {
	idempotency.Unit
	s *unreadCommit
}

func (u *lostCommitUnit) Commit() error {
	if err := u.Unit.Commit(); err != nil {
		return err
	}
	back := time.Now().Add(u.s.unreadable)
	u.s.back.CompareAndSwap(nil, &back)
	return errStore
}

// A unit's commit applies but its answer is lost, and the store cannot be
// read for as long as the middleware tries to settle that (10 s), then
// answers again. The record, completed by this execution's owner and
// generation, is read when the key is given up: it is this execution's
// completion, so the client gets its first answer (no replay marker) and
// the execution ended completed, whether the store came back at once or
// only after the reads gave up.
func TestACommitWhoseAnswerIsLostIsReadBackLate(t *testing.T) {
	for _, unreadable := range []time.Duration{0, 10 * time.Second} {
		t.Run(unreadable.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := &unreadCommit{Store: memstore.New(), unreadable: unreadable}
				s := &seen{}
				runs := 0
				g := idempotency.New(store, idempotency.WithLogger(quiet),
					idempotency.WithAnonymousKeys(true), idempotency.WithObserver(s.observer())).
					Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						runs++
						run, _ := idempotency.FromContext(r.Context())
						_, _, err := run.Unit(r.Context())
						require.NoError(t, err)
						w.WriteHeader(http.StatusCreated)
						_, _ = w.Write([]byte("paid"))
					}))
				first := send(t, g, "k", `{}`)
				require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
				require.Empty(t, first.Header().Get(idempotency.ReplayedHeader), "no replay")
				_, by := s.take()
				require.Len(t, by["executed"], 1)
				require.Equal(t, idempotency.OutcomeCompleted, by["executed"][0].Outcome,
					"error: %v", by["executed"][0].Err)
				again := send(t, g, "k", `{}`)
				require.Equal(t, "true", again.Header().Get(idempotency.ReplayedHeader))
				require.Equal(t, "paid", again.Body.String())
				require.Equal(t, 1, runs)
			})
		})
	}
}

// hungCommit is a memstore whose units' Commit hangs, as a COMMIT does on a
// connection the network dropped without a reset, until the context the
// unit was begun with ends (a SQL transaction keeps it, and its driver
// cancels the COMMIT with it); nothing is then applied.
type hungCommit struct{ *memstore.Store }

func (s hungCommit) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit,
	context.Context, error) {
	u, uctx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, uctx, err
	}
	return &hungCommitUnit{Unit: u, ctx: ctx}, uctx, nil
}

type hungCommitUnit struct {
	idempotency.Unit
	ctx context.Context
}

func (u *hungCommitUnit) Commit() error {
	<-u.ctx.Done()
	_ = u.Unit.Rollback()
	return context.Cause(u.ctx)
}

// A unit's Commit is bounded as every store call is: after 10 s the
// context the unit was begun with is canceled, the Commit returns, the
// record, still in progress, says nothing committed, and the client gets
// 503 idempotency_store_unavailable; the key is given up, and the retry
// runs again.
func TestAHungCommitIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := hungCommit{memstore.New()}
		runs := 0
		g := idempotency.New(store, idempotency.WithLogger(quiet),
			idempotency.WithAnonymousKeys(true)).
			Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				run, _ := idempotency.FromContext(r.Context())
				_, _, err := run.Unit(r.Context())
				require.NoError(t, err)
				w.WriteHeader(http.StatusCreated)
			}))
		start := time.Now()
		first := send(t, g, "k", `{}`)
		require.Equal(t, http.StatusServiceUnavailable, first.Code)
		require.Contains(t, first.Body.String(), string(idempotency.CodeStoreUnavailable))
		require.Equal(t, 10*time.Second, time.Since(start), "the commit's bound")
		_, err := store.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments",
			Key: "k"})
		require.ErrorIs(t, err, idempotency.ErrNotFound, "the key was given up")
		require.Equal(t, http.StatusServiceUnavailable, send(t, g, "k", `{}`).Code)
		require.Equal(t, 2, runs, "the retry ran again")
	})
}
