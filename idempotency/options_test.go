package idempotency_test

import (
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Every value of an option means what its documentation says, never the
// default in disguise.

// A request body limit of 0 or less accepts no body: a request with one
// gets 413 and runs nothing; a request without one runs.
func TestMaxRequestBodyZeroAcceptsNoBody(t *testing.T) {
	for _, limit := range []int64{0, -1} {
		var n atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
		srv := serve(t, memstore.New(), h, idempotency.WithMaxRequestBody(limit))
		requireProblem(t, post(t, srv, "with-body", "x"), http.StatusRequestEntityTooLarge,
			idempotency.CodeRequestTooLarge)
		require.Zero(t, n.Load(), "limit %d", limit)
		require.Equal(t, http.StatusCreated, post(t, srv, "no-body", "").Status, "limit %d", limit)
		require.EqualValues(t, 1, n.Load(), "limit %d", limit)
	}
}

// A stored body limit of 0 or less stores no response body: a response
// with one reaches its first client, and its replays answer 409
// CodeResponseNotReplayable; a response without one is replayed.
func TestMaxStoredBodyZeroStoresNoBody(t *testing.T) {
	for _, limit := range []int64{0, -1} {
		var n atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n.Add(1)
			body, _ := io.ReadAll(r.Body)
			if string(body) == `{"empty":true}` {
				w.WriteHeader(http.StatusNoContent)
				return
			}
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "y")
		})
		srv := serve(t, memstore.New(), h, idempotency.WithMaxStoredBody(limit))
		first := post(t, srv, "k", `{}`)
		require.Equal(t, http.StatusCreated, first.Status)
		require.Equal(t, "y", string(first.Body), "the first client gets the body")
		p := requireProblem(t, post(t, srv, "k", `{}`), http.StatusConflict, idempotency.CodeResponseNotReplayable)
		require.Equal(t, http.StatusCreated, p.OriginalStatus)

		require.Equal(t, http.StatusNoContent, post(t, srv, "empty", `{"empty":true}`).Status)
		replay := post(t, srv, "empty", `{"empty":true}`)
		require.Equal(t, http.StatusNoContent, replay.Status)
		require.Equal(t, "true", replay.Header.Get(idempotency.ReplayedHeader))
		require.EqualValues(t, 2, n.Load(), "limit %d: nothing ran twice", limit)
	}
}

// A lease below the minimum, 3 ms, is the minimum: the claim holds the
// record for 3 ms.
func TestLeaseBelowTheMinimumIsTheMinimum(t *testing.T) {
	for _, lease := range []time.Duration{time.Millisecond, 0, -time.Second, 3 * time.Millisecond, time.Minute} {
		synctest.Test(t, func(t *testing.T) {
			mem := memstore.New()
			release := make(chan struct{})
			h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLease(lease),
				idempotency.WithLogger(quiet)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				<-release
				w.WriteHeader(http.StatusCreated)
			}))
			start := time.Now()
			done := make(chan int)
			go func() { done <- send(t, h, "k", `{}`).Code }()
			synctest.Wait()
			rec, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
			require.NoError(t, err)
			require.Equal(t, max(lease, 3*time.Millisecond), rec.LeaseUntil.Sub(start), "WithLease(%v)", lease)
			close(release)
			require.Equal(t, http.StatusCreated, <-done)
		})
	}
}

// WithMismatchStatus takes any 4xx as given; any other value means 422.
func TestMismatchStatusTakesAny4xx(t *testing.T) {
	for status, want := range map[int]int{
		http.StatusConflict: http.StatusConflict, http.StatusUnprocessableEntity: http.StatusUnprocessableEntity,
		http.StatusBadRequest: http.StatusBadRequest, http.StatusPreconditionFailed: http.StatusPreconditionFailed,
		499: 499, 0: 422, 200: 422, 399: 422, 500: 422, -409: 422,
	} {
		srv := serve(t, memstore.New(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		}), idempotency.WithMismatchStatus(status))
		require.Equal(t, http.StatusCreated, post(t, srv, "k", `{"amount":1}`).Status)
		p := requireProblem(t, post(t, srv, "k", `{"amount":2}`), want, idempotency.CodeKeyReused)
		require.Equal(t, want, p.Status, "WithMismatchStatus(%d)", status)
	}
}
