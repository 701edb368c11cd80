// Command basic shows the smallest change that makes an existing client's
// retries safe: swap its Transport for a saferetry.Transport. It runs
// against a local flaky server (loopback only) and prints what happened.
//
//	go run ./examples/basic
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
)

func main() {
	if err := parseFlags(os.Args[1:], os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	if _, err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "basic:", err)
		os.Exit(1)
	}
}

const usage = `Usage: go run ./examples/basic

Swaps the Transport of an existing http.Client for a saferetry.Transport and
makes three calls to a local flaky server (loopback only): a GET retried
after two 503s, a POST retried with one automatic Idempotency-Key after a
502, and a 400 returned at once. It prints each attempt's log record and
what the server saw.
`

// parseFlags reads the command line, which takes no flag but -h: it
// returns flag.ErrHelp after writing the usage to w for -h, and an error
// for anything else.
func parseFlags(args []string, w io.Writer) error {
	fs := flag.NewFlagSet("basic", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() { fmt.Fprint(w, usage) }
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return nil
}

// flaky is a server that fails the first attempts of each path and records
// every request it receives.
type flaky struct {
	mu   sync.Mutex
	seen map[string][]string // path -> Idempotency-Key of each request ("" if none)
}

func (f *flaky) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.seen[r.URL.Path] = append(f.seen[r.URL.Path], r.Header.Get("Idempotency-Key"))
	n := len(f.seen[r.URL.Path])
	f.mu.Unlock()
	switch r.URL.Path {
	case "/inventory": // 503, 503, then 200
		if n <= 2 {
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, `{"widgets":12}`)
	case "/orders": // 502 (a gateway lost the answer), then 201
		if n == 1 {
			http.Error(w, "bad gateway", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintln(w, `{"order":"o-1"}`)
	default: // a client error: never retried
		http.Error(w, "no such thing", http.StatusBadRequest)
	}
}

func (f *flaky) requests(path string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.seen[path]...)
}

// outcome is what one call did, for the test.
type outcome struct {
	status   int
	requests []string // the Idempotency-Key the server saw on each request
}

// run makes three calls through an existing client whose Transport was
// swapped, and reports each.
func run(ctx context.Context, w io.Writer) (map[string]outcome, error) {
	srv := &flaky{seen: map[string][]string{}}
	ts := httptest.NewServer(srv)
	defer ts.Close()

	// An existing client, configured somewhere else in the program.
	client := &http.Client{Timeout: 10 * time.Second}

	// The one change: wrap its transport (nil means http.DefaultTransport).
	// Each attempt is logged; here Info and above go to w without the time.
	logger := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key {
			case slog.TimeKey, "elapsed", "total", "wait", "host", "key_digest":
				return slog.Attr{} // keep the output short and stable
			}
			return a
		},
	}))
	client.Transport = saferetry.NewTransport(client.Transport,
		saferetry.WithLogger(logger),
		// This program's own budget, one per host; by default every
		// Transport of a process shares one process-wide.
		saferetry.WithBudget(budget.NewRegistry(nil)))

	out := map[string]outcome{}
	call := func(method, path, body string) error {
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		req, err := http.NewRequestWithContext(ctx, method, ts.URL+path, rd)
		if err != nil {
			return err
		}
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		seen := srv.requests(path)
		out[method+" "+path] = outcome{status: resp.StatusCode, requests: seen}
		fmt.Fprintf(w, "=> %s %s: %s after %d request(s)", method, path, resp.Status, len(seen))
		if k := seen[0]; k != "" {
			fmt.Fprintf(w, "; every request carried Idempotency-Key %s", k)
		}
		fmt.Fprintln(w)
		return nil
	}

	fmt.Fprintln(w, "GET is idempotent: retried on 503 with full-jitter backoff.")
	if err := call(http.MethodGet, "/inventory", ""); err != nil {
		return out, err
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "POST is not: the Transport attaches one key before the first attempt and reuses it,")
	fmt.Fprintln(w, "so a server that honours it (package idempotency) can tell a retry from a new order.")
	if err := call(http.MethodPost, "/orders", `{"sku":"widget","qty":2}`); err != nil {
		return out, err
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "A 400 is the caller's mistake: returned at once, never retried.")
	if err := call(http.MethodGet, "/typo", ""); err != nil {
		return out, err
	}
	return out, nil
}
