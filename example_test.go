package saferetry_test

import (
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
