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
