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
