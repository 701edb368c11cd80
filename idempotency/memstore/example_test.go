package memstore_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// A store bounded to two records refuses a third key with 503
// idempotency_store_full (Retry-After: 1) while it still replays the keys
// it holds.
func ExampleNew() {
	mw := idempotency.New(memstore.New(memstore.WithMaxRecords(2)), idempotency.WithLogger(nil))
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	for _, key := range []string{"a", "b", "c", "a"} {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		r.Header.Set("Authorization", "Bearer acct-1")
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%s %d retry-after=%q replayed=%q\n", key, w.Code, w.Header().Get("Retry-After"),
			w.Header().Get(idempotency.ReplayedHeader))
	}
	// Output:
	// a 201 retry-after="" replayed=""
	// b 201 retry-after="" replayed=""
	// c 503 retry-after="1" replayed=""
	// a 201 retry-after="" replayed="true"
}

// A handler's own in-memory write (an order in a map) takes effect with
// the stored response, when the request's unit commits: a retry replays
// the answer and the order is recorded once.
func ExampleOnCommit() {
	orders := map[string]int{}
	store := memstore.New()
	mw := idempotency.New(store, idempotency.WithLogger(nil))
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := idempotency.FromContext(r.Context())
		u, _, err := run.Unit(r.Context())
		if err == nil {
			err = memstore.OnCommit(u, func() { orders[run.Scope.Key]++ }) // under the store's lock
		}
		if err != nil {
			http.Error(w, "storage failed", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for range 2 {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		r.Header.Set("Authorization", "Bearer acct-1")
		r.Header.Set("Idempotency-Key", "order-1")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%d replayed=%q orders=%v\n", w.Code, w.Header().Get(idempotency.ReplayedHeader), orders)
	}
	// Output:
	// 201 replayed="" orders=map[order-1:1]
	// 201 replayed="true" orders=map[order-1:1]
}
