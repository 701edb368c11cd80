package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// A client that times out does not make the work run again. Over real
// loopback, the client gives up after 100 ms while the guarded handler is
// still working; net/http cancels the request's context; the handler,
// released only after that, still has a live context (like a handler
// writing through a transaction bound to it, it would fail on a canceled
// one), so its response is stored, and the client's retry with the same
// key gets the replay: the work ran once.
func TestClientTimeoutDoesNotRerunTheWork(t *testing.T) {
	var runs atomic.Int64
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	seen := make(chan error, 1) // the handler's context error after the client left
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		if n == 1 {
			entered <- struct{}{}
			<-release
		}
		err := r.Context().Err()
		if n == 1 {
			seen <- err
		}
		if err != nil {
			// What a handler writing through its context gets (a
			// transaction's "context canceled"): the write fails.
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, n)
	})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet)).Wrap(h)
	// The request's own context as net/http gives it to the middleware:
	// it ends when net/http sees the client's connection close.
	reqCtx := make(chan context.Context, 2)
	served := make(chan struct{}, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reqCtx <- r.Context()
		mw.ServeHTTP(w, r)
		served <- struct{}{}
	}))
	t.Cleanup(srv.Close)
	var freeOnce sync.Once
	free := func() { freeOnce.Do(func() { close(release) }) }
	t.Cleanup(free) // before srv.Close, should the test stop early

	newReq := func() *http.Request {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":100}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Idempotency-Key", "pay-slow-1")
		return req
	}
	// The timeout only has to outlast sending the request over loopback:
	// the handler does not return before the client has gone.
	impatient := &http.Client{Timeout: 100 * time.Millisecond, Transport: &http.Transport{}}
	t.Cleanup(impatient.CloseIdleConnections)
	_, err := impatient.Do(newReq())
	require.Error(t, err, "the client must time out while the handler works")
	var ne interface{ Timeout() bool }
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "%v", err)

	select {
	case <-entered:
	case <-time.After(timeout):
		t.Fatal("the request never reached the handler: the client timed out before sending it")
	}
	ctx := <-reqCtx
	<-ctx.Done() // net/http saw the client go away
	free()
	require.NoError(t, <-seen, "the handler's context ended with the client")
	<-served // the first execution is settled

	// The client's retry, same key: the stored response, not a second run.
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	resp, err := client.Do(newReq())
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode, string(body))
	require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader))
	require.JSONEq(t, `{"payment":1}`, string(body))
	require.EqualValues(t, 1, runs.Load(), "the work ran again")
}
