package idemcheck_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Check an API that uses saferetry's middleware, as a go test would.
func Example() {
	var charges atomic.Int64
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, charges.Add(1))
	})
	mw := idempotency.New(memstore.New()) // scope: the Authorization header
	srv := httptest.NewServer(mw.Wrap(charge))
	defer srv.Close()

	rep, err := idemcheck.Run(context.Background(), idemcheck.Config{
		URL:  srv.URL + "/charges",
		Body: []byte(`{"amount":100}`),
		Header: http.Header{
			"Authorization": {"Bearer alice"},
			"Content-Type":  {"application/json"},
		},
		Other:         http.Header{"Authorization": {"Bearer bob"}},
		IDField:       "id",
		MaxRetryAfter: 10 * time.Millisecond, // a test need not wait a whole Retry-After
	})
	if err != nil {
		fmt.Println(err) // the target could not be checked
		return
	}
	for _, c := range rep.Checks {
		if c.Result == idemcheck.Fail {
			fmt.Println(c.Name, c.Detail) // in a test: t.Error(rep)
		}
	}
	fmt.Println(len(rep.Checks), "checks, failed:", rep.Failed())
	// Output:
	// 7 checks, failed: false
}
