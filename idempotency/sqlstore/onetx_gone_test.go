package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// A request that waits on a key another one-transaction request holds,
// under a long WithMaxInProgressWait, stops waiting when its client goes
// away (the wait is never past the request's context): its claim ends,
// committing nothing, and gives its connection back, instead of holding
// it for the rest of the wait. The holder then commits, and a retry
// replays its answer.
func TestOneTransactionWaitEndsWithTheClient(t *testing.T) {
	// Not on SQLite: its claim waits for the write lock up to its busy
	// timeout, which the driver does not cut short on a canceled context.
	forEachServer(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		entered, release := make(chan struct{}), make(chan struct{})
		hold := func(context.Context, *sql.Tx) { close(entered); <-release }
		claims := make(chan error, 4)
		srv, runs := oneTxServer(t, s, db, hold, idempotency.WithMaxInProgressWait(time.Hour),
			idempotency.WithObserver(idempotency.Observer{
				StoreCall: func(_ context.Context, e idempotency.Event) {
					if e.Op == idempotency.OpClaim {
						claims <- e.Err
					}
				}}))
		done := oneTxAsync(t, srv, "", "held")
		<-entered
		require.NoError(t, <-claims, "the holder's claim")

		ctx, cancel := context.WithCancel(t.Context())
		waiting := make(chan error, 1)
		go func() {
			_, err := oneTxSend(ctx, srv.Client(), srv.URL, "", "held")
			waiting <- err
		}()
		require.Eventually(t, func() bool { return db.Stats().InUse == 2 }, 10*time.Second,
			5*time.Millisecond, "the second request waits on the key, on a connection")
		cancel()
		require.ErrorIs(t, <-waiting, context.Canceled)
		select {
		case err := <-claims:
			require.Error(t, err, "the waiting claim ended without claiming")
		case <-time.After(10 * time.Second):
			close(release)
			t.Fatal("the claim still waits after its client went away")
		}
		require.Eventually(t, func() bool { return db.Stats().InUse == 1 }, 10*time.Second,
			5*time.Millisecond, "only the holder holds a connection")

		// Do: a call waiting on a key held by another call stops with its context.
		mw := idempotency.New(s, idempotency.WithOneTransaction(true), idempotency.WithLogger(nil),
			idempotency.WithMaxInProgressWait(time.Hour))
		call := idempotency.Call{Principal: "acct_1", Operation: "order", Key: "held-do"}
		doEntered, doRelease, doDone := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		go func() {
			_, err := mw.Do(t.Context(), call, func(context.Context, *idempotency.Run) ([]byte, error) {
				close(doEntered)
				<-doRelease
				return []byte("out"), nil
			})
			doDone <- err
		}()
		<-doEntered
		dctx, dcancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer dcancel()
		_, err := mw.Do(dctx, call, func(context.Context, *idempotency.Run) ([]byte, error) {
			return nil, errors.New("must not run")
		})
		require.ErrorIs(t, err, idempotency.ErrInProgress)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		close(doRelease)
		require.NoError(t, <-doDone)

		close(release)
		first := done()
		require.Equal(t, http.StatusCreated, first.status, first.body)
		again := oneTxPost(t, srv, "", "held")
		require.True(t, again.replayed)
		require.EqualValues(t, 1, runs.Load())
		require.Zero(t, db.Stats().InUse)
	})
}
