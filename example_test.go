package saferetry_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/keygen"
)

// A payments API that fails twice with 503 before it answers.
func flakyServer() *httptest.Server {
	var n atomic.Int32
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintf(w, "charged, key %s", r.Header.Get("Idempotency-Key"))
	}))
}

func ExampleNewTransport() {
	srv := flakyServer()
	defer srv.Close()

	client := &http.Client{Transport: saferetry.NewTransport(http.DefaultTransport,
		saferetry.WithMaxAttempts(3),
		saferetry.WithBackoff(jitter.Config{Base: time.Millisecond}), // short waits for the example
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))}

	// An event-derived key: the same order always carries the same key.
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":1000}`))
	req.Header.Set("Idempotency-Key", keygen.Event("order-charge", "42"))
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(body))
	// Output: 200 charged, key order-charge-42
}

func ExampleNewClient() {
	srv := flakyServer()
	defer srv.Close()

	client := saferetry.NewClient(
		saferetry.WithBackoff(jitter.Config{Base: time.Millisecond}),
		saferetry.WithBudget(budget.Unlimited()),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))

	// No key set: the Transport attaches one random key and reuses it.
	resp, err := client.Post(srv.URL+"/charges", "application/json", strings.NewReader(`{"amount":1000}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	key := resp.Request.Header.Get("Idempotency-Key")
	fmt.Println(resp.StatusCode, len(key))
	// Output: 200 36
}

func ExampleWithHedging() {
	// A payments API behind the idempotency middleware whose first request
	// is stuck for a while before it reaches the service (a stalled
	// instance); the others go straight through.
	var hits atomic.Int32
	charge := idempotency.New(memstore.New(), idempotency.WithLogger(nil)).Wrap(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, "charged")
		}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Read the body first: net/http notices a client that went away
		// only once it has.
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		if hits.Add(1) == 1 {
			select {
			case <-time.After(10 * time.Second):
			case <-r.Context().Done(): // the Transport canceled it: its hedge won
				return
			}
		}
		charge.ServeHTTP(w, r)
	}))
	defer srv.Close()

	client := saferetry.NewClient(
		saferetry.WithHedging(saferetry.Hedging{Delay: 50 * time.Millisecond}),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))

	// A POST with a key is hedged: the hedge carries the same key, so the
	// charge is made once whichever attempt reaches the service first.
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":1000}`))
	req.Header.Set("Authorization", "Bearer merchant-7")
	req.Header.Set("Idempotency-Key", keygen.Event("order-charge", "42"))
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(body), "from attempt", resp.Request.Header.Get("Request-Attempt"))
	// Output: 201 charged from attempt 2
}
