package sqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// One-transaction executions that end abnormally: a handler that panics
// (HTTP and Do), a client that goes away in the middle (HTTP: the handler
// goes on and commits; Do: its context is canceled, fn returns its error),
// and a fn that fails. Each leaves no record when nothing is stored, the
// completed record when it is, holds no connection afterwards, and the
// retry runs at most once.
func TestOneTransactionAbnormalEnds(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		_, err := db.Exec(`CREATE TABLE onetx_orders (id VARCHAR(200) PRIMARY KEY)`)
		require.NoError(t, err)
		executed := make(chan idempotency.Outcome, 16)
		mw := idempotency.New(s, idempotency.WithOneTransaction(true), idempotency.WithLogger(nil),
			idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }),
			idempotency.WithObserver(idempotency.Observer{
				Executed: func(_ context.Context, e idempotency.Event) { executed <- e.Outcome }}))
		insert := func(ctx context.Context, key string) error {
			tx, ok := sqlstore.Tx(ctx)
			if !ok {
				return errors.New("no transaction")
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO onetx_orders (id) VALUES ($1)`, key)
			return err
		}
		var runs atomic.Int64
		entered, release := make(chan struct{}, 1), make(chan struct{})
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			key := r.Header.Get("Idempotency-Key")
			if err := insert(r.Context(), key); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			switch r.URL.Query().Get("mode") {
			case "panic":
				panic("boom")
			case "hold":
				entered <- struct{}{}
				<-release
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = fmt.Fprintf(w, "order %s", key)
		})
		srv := httptest.NewUnstartedServer(mw.Wrap(h))
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the panic's stack
		srv.Start()
		t.Cleanup(srv.Close)
		idle := func() {
			t.Helper()
			require.Zero(t, db.Stats().InUse, "no connection is held")
		}

		// A handler that panics: the server drops the connection; nothing is left.
		_, err = oneTxSend(t.Context(), srv.Client(), srv.URL, "?mode=panic", "p1")
		require.Error(t, err, "net/http drops the connection of a panicking handler")
		require.Equal(t, idempotency.OutcomePanicked, <-executed)
		orders, records := oneTxCounts(t, db, "p1")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records})
		idle()
		retry := oneTxPost(t, srv, "?mode=fine", "p1")
		require.Equal(t, http.StatusCreated, retry.status, retry.body)
		require.Equal(t, idempotency.OutcomeCompleted, <-executed)
		require.EqualValues(t, 2, runs.Load())

		// A client that goes away in the middle: the handler goes on and commits.
		ctx, cancel := context.WithCancel(t.Context())
		gone := make(chan error, 1)
		go func() {
			_, err := oneTxSend(ctx, srv.Client(), srv.URL, "?mode=hold", "c1")
			gone <- err
		}()
		<-entered
		cancel()
		require.ErrorIs(t, <-gone, context.Canceled)
		close(release)
		require.Equal(t, idempotency.OutcomeCompleted, <-executed)
		orders, records = oneTxCounts(t, db, "c1")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
		idle()
		replay := oneTxPost(t, srv, "?mode=hold", "c1")
		require.True(t, replay.replayed, "%d %s", replay.status, replay.body)
		require.Equal(t, "order c1", replay.body)
		require.EqualValues(t, 3, runs.Load())

		// Do: a fn that fails, one that panics, one whose caller goes away.
		do := func(ctx context.Context, key string, fn func(ctx context.Context) error) error {
			_, err := mw.Do(ctx, idempotency.Call{Principal: "acct_1", Operation: "order", Key: key},
				func(ctx context.Context, _ *idempotency.Run) ([]byte, error) {
					if err := insert(ctx, key); err != nil {
						return nil, err
					}
					return []byte("ok"), fn(ctx)
				})
			return err
		}
		fail := errors.New("declined")
		require.ErrorIs(t, do(t.Context(), "d1", func(context.Context) error { return fail }), fail)
		var pe *idempotency.PanicError
		require.ErrorAs(t, do(t.Context(), "d2", func(context.Context) error { panic("boom") }), &pe)
		dctx, dcancel := context.WithCancel(t.Context())
		require.ErrorIs(t, do(dctx, "d3", func(ctx context.Context) error {
			dcancel()
			<-ctx.Done()
			return ctx.Err()
		}), context.Canceled)
		for _, want := range []idempotency.Outcome{idempotency.OutcomeReleased,
			idempotency.OutcomePanicked, idempotency.OutcomeReleased} {
			select {
			case got := <-executed:
				require.Equal(t, want, got)
			case <-time.After(10 * time.Second):
				t.Fatal("no execution reported")
			}
		}
		for _, key := range []string{"d1", "d2", "d3"} {
			orders, records := oneTxCounts(t, db, key)
			require.Equal(t, [2]int{0, 0}, [2]int{orders, records}, key)
		}
		idle()
		require.NoError(t, do(t.Context(), "d1", func(context.Context) error { return nil }))
	})
}
