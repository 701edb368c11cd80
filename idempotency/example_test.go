package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

func ExampleNew() {
	var charges atomic.Int64
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1) // the side effect
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":%d}`, n)
	})

	store := memstore.New()
	mw := idempotency.New(store, idempotency.WithPrincipal(func(r *http.Request) (string, error) {
		return r.Header.Get("X-Account"), nil // use the authenticated identity
	}))
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send := func(key, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(body))
		req.Header.Set("X-Account", "acct-42")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Println(resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), strings.TrimSpace(string(b)))
	}
	send("order-7-charge", `{"amount":100}`)
	send("order-7-charge", `{"amount":100}`) // a retry: replayed, not charged again
	send("order-7-charge", `{"amount":200}`) // the same key for another request
	fmt.Println("charges:", charges.Load())
	// Output:
	// 201  {"charge":1}
	// 201 true {"charge":1}
	// 422  {"type":"https://saferetry.dev/problems/idempotency_key_reused","title":"The idempotency key was used for a different request","status":422,"code":"idempotency_key_reused","detail":"this idempotency key was already used for a different request; use a new key for a new request"}
	// charges: 1
}

// The Reaper deletes the records past the middleware's cleanup horizon: here
// a one-hour replay window and a two-hour horizon.
func ExampleMiddleware_Reaper() {
	store := memstore.New()
	mw := idempotency.New(store, idempotency.WithLogger(nil),
		idempotency.WithReplayWindow(time.Hour), idempotency.WithCleanupHorizon(2*time.Hour))
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	for _, key := range []string{"a", "b"} {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		r.Header.Set("Authorization", "Bearer acct-1")
		r.Header.Set("Idempotency-Key", key)
		h.ServeHTTP(httptest.NewRecorder(), r)
	}
	rep, err := mw.Reaper().ReapOnce(context.Background(), time.Now().Add(3*time.Hour))
	fmt.Println(rep.Deleted, err, store.Len())
	// Output: 2 <nil> 0
}
