package idempotency_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// A charge that takes longer than the client waits answers 202 Accepted
// with its monitor in Location; the monitor says in progress, then gives
// the stored response. A lookup by key (no identifier, the key in a
// header) answers the same; another principal gets 404.
func ExampleMiddleware_Monitor() {
	release := make(chan struct{})
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release // the card network is slow
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"charge":"ch_1"}`)
	})
	secret := bytes.Repeat([]byte("x"), 32) // in production: 32 random bytes from a secret store
	mw := idempotency.New(memstore.New(),
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil // use the authenticated identity
		}),
		idempotency.WithMonitor("/operations/", secret),
		idempotency.WithAcceptAfter(50*time.Millisecond))
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))
	mux.Handle("GET /operations/", mw.Monitor(mux))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	type answer struct {
		status          int
		replayed, label string
		header          http.Header
	}
	send := func(method, path, account string, header ...string) answer {
		var body io.Reader
		if method == http.MethodPost {
			body = strings.NewReader(`{"amount":100}`)
		}
		req, _ := http.NewRequest(method, srv.URL+path, body)
		req.Header.Set("X-Account", account)
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		label := strings.TrimSpace(string(b))
		if resp.StatusCode == http.StatusAccepted {
			label = "in progress" // the status body: {"status":"in_progress","age_ms":...}
		}
		return answer{resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), label, resp.Header}
	}
	show := func(a answer) { fmt.Println(a.status, a.replayed, a.label) }

	accepted := send(http.MethodPost, "/charges", "acct-42", "Idempotency-Key", "order-7-charge")
	show(accepted)
	monitor := accepted.header.Get("Location")     // "/operations/" and a sealed identifier
	show(send(http.MethodGet, monitor, "acct-42")) // still running: Retry-After: 1
	other := send(http.MethodGet, monitor, "acct-9")
	fmt.Println(other.status, other.header.Get("Content-Type")) // another principal
	close(release)
	for send(http.MethodGet, monitor, "acct-42").status == http.StatusAccepted {
		time.Sleep(10 * time.Millisecond)
	}
	show(send(http.MethodGet, monitor, "acct-42"))       // the stored response
	show(send(http.MethodGet, "/operations/", "acct-42", // a lookup by key
		"Idempotency-Key", "order-7-charge", "Idempotency-Lookup", "POST /charges"))
	fmt.Println("the key in the monitor URL:", strings.Contains(monitor, "order-7"))
	// Output:
	// 202  in progress
	// 202  in progress
	// 404 application/problem+json
	// 201 true {"charge":"ch_1"}
	// 201 true {"charge":"ch_1"}
	// the key in the monitor URL: false
}
