package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// hungStore is a memstore whose call named hang never answers: it waits
// for its context to end (a lock held elsewhere, a partition, a pool with
// no free connection). Made in a testing/synctest bubble, a call that no
// context ends is a deadlock the bubble reports.
type hungStore struct {
	*memstore.Store
	hang  string
	never chan struct{}
}

func hung(op string) hungStore {
	return hungStore{Store: memstore.New(), hang: op, never: make(chan struct{})}
}

func (h hungStore) wait(ctx context.Context, op string) error {
	if h.hang != op {
		return nil
	}
	if ctx.Done() == nil {
		<-h.never // no context can end it: durably blocked
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-h.never:
		return nil
	}
}

func (h hungStore) Get(ctx context.Context, s idempotency.Scope) (idempotency.Record, error) {
	if err := h.wait(ctx, "get"); err != nil {
		return idempotency.Record{}, err
	}
	return h.Store.Get(ctx, s)
}

func (h hungStore) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	if err := h.wait(ctx, "claim"); err != nil {
		return idempotency.ClaimResult{}, err
	}
	return h.Store.Claim(ctx, c)
}

func (h hungStore) Abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	if err := h.wait(ctx, "abandoned"); err != nil {
		return nil, err
	}
	return h.Store.Abandoned(ctx, now, limit)
}

func (h hungStore) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if err := h.wait(ctx, "delete_before"); err != nil {
		return 0, err
	}
	return h.Store.DeleteBefore(ctx, horizon, limit)
}

func (h hungStore) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit, context.Context, error) {
	if err := h.wait(ctx, "begin"); err != nil {
		return nil, ctx, err
	}
	return h.Store.Begin(ctx, l)
}

// within returns f's result, or fails t when f has not returned after d on
// the bubble's clock (a heartbeat keeps the clock going, so a call that
// hangs is no deadlock that synctest reports).
func within[T any](t *testing.T, d time.Duration, f func() T) T {
	t.Helper()
	done := make(chan T, 1)
	go func() { done <- f() }()
	select {
	case v := <-done:
		return v
	case <-time.After(d):
		t.Fatalf("still waiting after %v", d)
		panic("unreachable")
	}
}

// Every store call the library makes on its own behalf gives up after the
// store timeout (10 s), even on a context without a deadline: a hung store
// answers 503 or fails a job's run; it never stops a request or a job for
// good.
func TestEveryStoreCallIsBoundedInTime(t *testing.T) {
	const bound = 10 * time.Second
	job := func(name, hang string, run func(mw *idempotency.Middleware) error) {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := hung(hang)
				crashed(t, store.Store, shopScope, "/payments", `{}`, time.Now().Add(-100*time.Hour))
				mw := idempotency.New(store, idempotency.WithLogger(quiet))
				start := time.Now()
				err := run(mw)
				require.ErrorIs(t, err, context.DeadlineExceeded)
				require.Equal(t, bound, time.Since(start))
			})
		})
	}
	reap := func(mw *idempotency.Middleware) error {
		_, err := mw.Reaper().ReapOnce(context.Background(), time.Now())
		return err
	}
	complete := func(mw *idempotency.Middleware) error {
		_, err := mw.Completer(map[string]http.Handler{"POST /payments": http.NotFoundHandler()}).
			RunOnce(context.Background())
		return err
	}
	job("reaper abandoned", "abandoned", reap)
	job("reaper delete_before", "delete_before", reap)
	job("reaper get", "get", reap)
	job("completer abandoned", "abandoned", complete)
	job("completer claim", "claim", complete)

	// A request waiting on a key in progress (WithMaxInProgressWait) reads
	// the record; that read is bounded too.
	t.Run("in-progress wait", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			release := make(chan struct{})
			h := idempotency.New(hung("get"), idempotency.WithLogger(quiet),
				idempotency.WithAnonymousKeys(true), idempotency.WithMaxInProgressWait(time.Hour)).
				Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					<-release
					w.WriteHeader(http.StatusCreated)
				}))
			first := make(chan int)
			go func() { first <- send(t, h, "k", `{}`).Code }()
			synctest.Wait()
			start := time.Now()
			second := within(t, time.Hour, func() *httptest.ResponseRecorder { return send(t, h, "k", `{}`) })
			require.Equal(t, http.StatusServiceUnavailable, second.Code, second.Body.String())
			require.Contains(t, second.Body.String(), string(idempotency.CodeStoreUnavailable))
			require.Less(t, time.Since(start), bound+time.Second)
			close(release)
			require.Equal(t, http.StatusCreated, <-first)
		})
	})

	// A unit of work that cannot begin (no free connection in the pool)
	// fails its phase, or the request's unit, after the bound; a unit
	// that began lives as long as its work.
	t.Run("begin", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var phaseErr, unitErr error
			var took time.Duration
			h := idempotency.New(hung("begin"), idempotency.WithLogger(quiet),
				idempotency.WithAnonymousKeys(true)).
				Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					run, _ := idempotency.FromContext(r.Context())
					start := time.Now()
					_, phaseErr = run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return nil, nil })
					_, _, unitErr = run.Unit(r.Context())
					took = time.Since(start)
					w.WriteHeader(http.StatusCreated)
				}))
			a := within(t, time.Hour, func() *httptest.ResponseRecorder { return send(t, h, "k", `{}`) })
			require.Equal(t, http.StatusServiceUnavailable, a.Code, "nothing of the unit committed")
			var pe *idempotency.PhaseError
			require.ErrorAs(t, phaseErr, &pe)
			require.Equal(t, "begin", pe.Step)
			require.ErrorIs(t, phaseErr, context.DeadlineExceeded)
			require.ErrorIs(t, unitErr, context.DeadlineExceeded)
			require.Equal(t, 2*bound, took)
		})
	})
	t.Run("a unit that began outlives the bound", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			h := idempotency.New(hung(""), idempotency.WithLogger(quiet),
				idempotency.WithAnonymousKeys(true)).
				Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					run, _ := idempotency.FromContext(r.Context())
					_, uctx, err := run.Unit(r.Context())
					require.NoError(t, err)
					time.Sleep(time.Minute) // long work in the unit
					require.NoError(t, uctx.Err())
					w.WriteHeader(http.StatusCreated)
				}))
			require.Equal(t, http.StatusCreated, send(t, h, "k", `{}`).Code)
		})
	})
}
