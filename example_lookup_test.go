package saferetry_test

import (
	"context"
	"errors"
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
)

// When the retries run out without a definitive answer, ask the server's
// monitor what became of the request, and send it again, with the same
// key, only when the server never got it (absent). Against a server
// without a monitor, fall back to sending it again with the same key,
// which a server that de-duplicates answers with the stored response.
func ExampleTransport_Lookup() {
	var charges atomic.Int64
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d"}`, charges.Add(1))
	})
	account := func(r *http.Request) (string, error) { return r.Header.Get("Authorization"), nil }
	mw := idempotency.New(memstore.New(), idempotency.WithPrincipal(account),
		idempotency.WithLogger(nil))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(pay))
	mux.Handle("GET /operations/", mw.Monitor(mux))
	noMonitor := http.NewServeMux() // the same API, without a monitor
	noMonitor.Handle("POST /payments", mw.Wrap(pay))

	// A gateway in front of the API loses, during an outage, the answer to
	// order-1 after forwarding it, and order-2 and order-3 before.
	var outage atomic.Bool
	gateway := func(api http.Handler) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			key := r.Header.Get("Idempotency-Key")
			if outage.Load() && r.Method == http.MethodPost {
				if key == "order-1" {
					api.ServeHTTP(httptest.NewRecorder(), r)
				}
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			api.ServeHTTP(w, r)
		}))
	}
	withMonitor, without := gateway(mux), gateway(noMonitor)
	defer withMonitor.Close()
	defer without.Close()

	tr := saferetry.NewTransport(nil, saferetry.WithMaxAttempts(2),
		saferetry.WithBackoff(jitter.Config{Base: time.Millisecond}),
		saferetry.WithBudget(budget.Unlimited()), saferetry.WithLogger(slog.New(slog.DiscardHandler)))
	client := &http.Client{Transport: tr}
	ctx := context.Background()
	newRequest := func(api, key string) *http.Request {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api+"/payments",
			strings.NewReader(`{"amount":100}`))
		req.Header.Set("Authorization", "Bearer acct-42")
		req.Header.Set("Idempotency-Key", key) // derived from the order: the same every time
		return req
	}
	show := func(what string, resp *http.Response) {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(what, resp.StatusCode, string(b))
	}

	outage.Store(true)
	unknown := map[string]string{} // key -> API: what the caller must resolve
	for key, api := range map[string]string{"order-1": withMonitor.URL, "order-2": withMonitor.URL,
		"order-3": without.URL} {
		resp, err := client.Do(newRequest(api, key))
		if saferetry.Definitive(resp, err) {
			show(key, resp)
			continue
		}
		if resp != nil {
			resp.Body.Close()
		}
		unknown[key] = api // keep it, with its key, and resolve it later
	}
	outage.Store(false)

	for _, key := range []string{"order-1", "order-2", "order-3"} {
		api := unknown[key]
		res, err := tr.Lookup(ctx, api+"/operations/", newRequest(api, key), "")
		switch {
		case errors.Is(err, saferetry.ErrNoMonitor):
			fmt.Print(key, ": no monitor; ")
		case err != nil:
			fmt.Println(key, ": still unknown, ask again later:", err)
			continue
		case res.State == saferetry.OperationCompleted:
			show(key+": completed, not sent again:", res.Response)
			continue
		case res.State == saferetry.OperationInProgress:
			fmt.Println(key, ": in progress, ask again after", res.RetryAfter)
			continue
		default:
			fmt.Print(key, ": absent; ")
		}
		resp, err := client.Do(newRequest(api, key)) // the same key: it runs at most once
		if err != nil {
			fmt.Println(err)
			continue
		}
		show("sent again:", resp)
	}
	fmt.Println("charges:", charges.Load())
	// Output:
	// order-1: completed, not sent again: 201 {"charge":"ch_1"}
	// order-2: absent; sent again: 201 {"charge":"ch_2"}
	// order-3: no monitor; sent again: 201 {"charge":"ch_3"}
	// charges: 3
}
