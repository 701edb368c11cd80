package idemcheck_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// newStore is the one place this file makes a store.
func newStore() idempotency.Store { return memstore.New() }

// accounts stands in for authentication: a bearer token names an account.
var accounts = map[string]string{"Bearer tok_1": "acct_1", "Bearer tok_2": "acct_2"}

func principal(r *http.Request) (string, error) {
	if a, ok := accounts[r.Header.Get("Authorization")]; ok {
		return a, nil
	}
	return "", fmt.Errorf("unknown credentials: %w", idempotency.ErrPrincipalRefused)
}

// holdConcurrent makes the conflicts of the concurrent check certain: the
// one execution of its key waits until the middleware has answered the
// other n-1 duplicates (with 409, since the key is in progress). The
// checker names its keys after its checks (idemcheck-concurrent-...).
type holdConcurrent struct {
	n        int
	requests atomic.Int64 // every request, counted as it arrives
	mu       sync.Mutex
	answered map[string]int
	released map[string]chan struct{}
}

func (h *holdConcurrent) ch(key string) chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.released[key] == nil {
		h.released[key] = make(chan struct{})
	}
	return h.released[key]
}

// outer counts the answers the middleware wrote, per key.
func (h *holdConcurrent) outer(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.requests.Add(1)
		next.ServeHTTP(w, r)
		key := r.Header.Get("Idempotency-Key")
		ch := h.ch(key)
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.answered[key]++; h.answered[key] == h.n-1 {
			close(ch)
		}
	})
}

// wait holds the execution of a concurrent-check key (at most 10 s).
func (h *holdConcurrent) wait(key string) {
	if !strings.HasPrefix(key, "idemcheck-concurrent-") {
		return
	}
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-h.ch(key):
	case <-t.C:
	}
}

// serveMiddleware serves the middleware over store on POST /payments: each
// execution creates one effect, eff_<n>.
func serveMiddleware(t *testing.T, store idempotency.Store, n int) (*httptest.Server, *atomic.Int64, *holdConcurrent) {
	t.Helper()
	var effects atomic.Int64
	hold := &holdConcurrent{n: n, answered: map[string]int{}, released: map[string]chan struct{}{}}
	mw := idempotency.New(store, idempotency.WithPrincipal(principal),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		hold.wait(r.Header.Get("Idempotency-Key"))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"eff_%d","bytes":%d}`, effects.Add(1), len(body))
	})))
	srv := httptest.NewServer(hold.outer(mux))
	t.Cleanup(srv.Close)
	return srv, &effects, hold
}

// config is the checker's configuration for a server from serveMiddleware
// or the broken servers.
func config(url string, n int) idemcheck.Config {
	return idemcheck.Config{
		URL:  url + "/payments",
		Body: []byte(`{"order":"42","amount":4200}`),
		Header: http.Header{
			"Authorization": {"Bearer tok_1"},
			"Content-Type":  {"application/json"},
		},
		Other:         http.Header{"Authorization": {"Bearer tok_2"}},
		IDField:       "id",
		N:             n,
		Timeout:       10 * time.Second,
		MaxRetryAfter: time.Millisecond, // the middleware's Retry-After: 1, shortened
	}
}

func results(rep idemcheck.Report) map[string]idemcheck.Result {
	m := map[string]idemcheck.Result{}
	for _, c := range rep.Checks {
		m[c.Name] = c.Result
	}
	return m
}

// want is what the project's middleware gets from every check.
var want = map[string]idemcheck.Result{
	"replay":      idemcheck.Pass,
	"concurrent":  idemcheck.Pass,
	"in_progress": idemcheck.Info,
	"mismatch":    idemcheck.Pass,
	"scope":       idemcheck.Pass,
	"invalid_key": idemcheck.Pass,
	"marker":      idemcheck.Info,
}

func TestMiddlewarePassesEveryCheck(t *testing.T) {
	const n = 8
	srv, effects, hold := serveMiddleware(t, newStore(), n)
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, n))
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.Equal(t, want, results(rep))
	require.False(t, rep.Failed())
	require.Contains(t, rep.String(), "no check failed (7 checks: 5 pass, 2 info)")

	byName := map[string]idemcheck.Check{}
	for _, c := range rep.Checks {
		byName[c.Name] = c
		require.NotEmpty(t, c.Detail, c.Name)
		require.NotEmpty(t, c.Evidence, c.Name)
	}
	require.Contains(t, byName["concurrent"].Detail, "made one effect")
	require.Contains(t, byName["concurrent"].Detail, fmt.Sprintf("1 answered with it (its execution and replays), %d with a conflict", n-1))
	require.Contains(t, byName["in_progress"].Detail,
		"409 idempotency_request_in_progress, Retry-After: 1; the retry after it got the replay")
	require.Contains(t, byName["mismatch"].Detail, "422 idempotency_key_reused")
	require.Contains(t, byName["mismatch"].Evidence[0], `"amount":4201`)
	require.Contains(t, byName["invalid_key"].Detail, "400 idempotency_key_invalid")
	require.Contains(t, byName["marker"].Detail, "the replay carried Idempotent-Replayed: true")
	require.Contains(t, byName["marker"].Detail, "a key with spaces: accepted (201), its retry got the replay")
	require.Contains(t, byName["marker"].Detail, "an sf-string key: accepted (201), its bare form")
	require.Contains(t, byName["marker"].Detail, "got the replay")

	// The effects the run made: the first request and the second under a
	// fresh key, the concurrent key, the mismatch control, the second
	// principal and the two marker keys.
	require.Equal(t, int64(7), effects.Load())
	// The requests: 13, the n duplicates and the one retry after a conflict.
	require.Equal(t, int64(13+n+1), hold.requests.Load())
}

func TestRunAgainUsesFreshKeys(t *testing.T) {
	srv, effects, _ := serveMiddleware(t, newStore(), 2)
	for range 2 {
		rep, err := idemcheck.Run(t.Context(), config(srv.URL, 2))
		require.NoError(t, err)
		require.False(t, rep.Failed(), rep.String())
	}
	require.Equal(t, int64(14), effects.Load(), "the second run replayed nothing of the first")
}

// When the concurrent check's burst sees no conflict (the work is quicker
// than the burst), in_progress sends up to two more bursts under fresh
// keys and reports the conflict one of them sees, instead of skipping.
func TestInProgressLooksForAConflictInMoreBursts(t *testing.T) {
	const n = 4
	var effects atomic.Int64
	var serial sync.Mutex // the quick bursts: one request at a time, so each duplicate gets the replay
	var mu sync.Mutex
	order := map[string]int{}       // in_progress keys, numbered as they arrive
	slow := func(key string) bool { // the second extra burst's key
		if !strings.HasPrefix(key, "idemcheck-in_progress-") {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if order[key] == 0 {
			order[key] = len(order) + 1
		}
		return order[key] == 2
	}
	answered := make(chan struct{}, n)
	mw := idempotency.New(newStore(), idempotency.WithPrincipal(principal),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if slow(r.Header.Get("Idempotency-Key")) {
			for range n - 1 { // the duplicates got their answer (409) first
				<-answered
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
	})))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		switch {
		case slow(key):
			mux.ServeHTTP(w, r)
			answered <- struct{}{}
		case strings.HasPrefix(key, "idemcheck-concurrent-"), strings.HasPrefix(key, "idemcheck-in_progress-"):
			serial.Lock()
			mux.ServeHTTP(w, r)
			serial.Unlock()
		default:
			mux.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, n))
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.False(t, rep.Failed())
	ip := rep.Checks[2]
	require.Equal(t, "in_progress", ip.Name)
	require.Equal(t, idemcheck.Info, ip.Result, ip.Detail)
	require.Contains(t, ip.Detail, "409 idempotency_request_in_progress, Retry-After: 1; the retry after it got the replay")
	require.Contains(t, ip.Evidence[0], "burst 2: key \"idemcheck-in_progress-")
	require.Equal(t, 0, strings.Count(withoutKeys(ip.Evidence[0]), "409"))
	require.Contains(t, ip.Evidence[1], "burst 3: key \"idemcheck-in_progress-")
	require.Equal(t, n-1, strings.Count(withoutKeys(ip.Evidence[1]), "409"))
}

// withoutKeys blanks the quoted strings of an evidence line, the random keys
// among them, so that a count of statuses cannot find one inside a key.
func withoutKeys(evidence string) string {
	return regexp.MustCompile(`"[^"]*"`).ReplaceAllString(evidence, `""`)
}
