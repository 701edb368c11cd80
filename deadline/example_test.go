package deadline_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/jitter"
)

// A handler behind Middleware sees the client's remaining time as its
// context's deadline.
func ExampleMiddleware() {
	h := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, ok := r.Context().Deadline()
		fmt.Fprint(w, ok)
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", nil)
	req.Header.Set(deadline.Header, "2500") // what a saferetry Transport sends
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println("deadline:", rec.Body.String())
	// Output: deadline: true
}

// An operator's access log or metrics, placed behind Middleware, counts
// what share of a service's load is retries.
func ExampleAttempt() {
	var first, retries, unknown atomic.Int64
	count := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch n := deadline.Attempt(r.Context()); {
			case n == 1:
				first.Add(1)
			case n > 1:
				retries.Add(1)
			default: // a client that sends no attempt number
				unknown.Add(1)
			}
			next.ServeHTTP(w, r)
		})
	}
	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})
	h := deadline.Middleware(count(app))
	for _, attempt := range []string{"1", "2", "3", "1", ""} { // what saferetry Transports send
		req := httptest.NewRequest(http.MethodGet, "/orders/42", nil)
		if attempt != "" {
			req.Header.Set("Request-Attempt", attempt)
		}
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	fmt.Printf("first tries %d, retries %d, unknown %d\n", first.Load(), retries.Load(), unknown.Load())
	// Output: first tries 2, retries 2, unknown 1
}

// The idempotency middleware's observers receive the request's context, so
// they see the attempt number too: here, a retry that found its first
// attempt's stored answer.
func ExampleAttempt_idempotencyObserver() {
	obs := idempotency.Observer{
		Executed: func(ctx context.Context, e idempotency.Event) {
			fmt.Println("executed on attempt", deadline.Attempt(ctx))
		},
		Replayed: func(ctx context.Context, e idempotency.Event) {
			fmt.Println("replayed on attempt", deadline.Attempt(ctx))
		},
	}
	mw := idempotency.New(memstore.New(), idempotency.WithObserver(obs), idempotency.WithLogger(nil))
	h := deadline.Middleware(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	for _, attempt := range []string{"1", "2"} {
		req := httptest.NewRequest(http.MethodPost, "/payments", nil)
		req.Header.Set("Authorization", "Bearer acct_1")
		req.Header.Set("Idempotency-Key", "order-42")
		req.Header.Set("Request-Attempt", attempt)
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	// Output:
	// executed on attempt 1
	// replayed on attempt 2
}

// Pushback: a service behind Middleware whose call below gave up after
// retrying answers its own failure marked "Retried-Below: true", which no
// saferetry Transport above retries. The handler needs no code of its own
// for it: it makes its call with the request's context.
func ExampleMiddleware_pushback() {
	var hits atomic.Int64
	inventory := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable) // down
	}))
	defer inventory.Close()
	client := &http.Client{Transport: saferetry.NewTransport(nil, saferetry.WithLogger(nil),
		saferetry.WithBackoff(jitter.Config{Base: time.Millisecond}))} // 3 attempts

	orders := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), http.MethodGet, inventory.URL, nil)
		resp, err := client.Do(req)
		if err != nil {
			http.Error(w, "inventory unreachable", http.StatusBadGateway)
			return
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			http.Error(w, "inventory unavailable", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "order placed")
	}))
	rec := httptest.NewRecorder()
	orders.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/orders", nil))
	fmt.Println("inventory hits:", hits.Load())
	fmt.Println(rec.Code, "Retried-Below:", rec.Header().Get("Retried-Below"))
	// Output:
	// inventory hits: 3
	// 503 Retried-Below: true
}
