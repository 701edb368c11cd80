package idemcheck_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
)

// serveMonitored serves the middleware, with its status monitor at
// /operations/, on POST /payments, as serveMiddleware does; monitor wraps
// the monitor (a broken one, for the failures).
func serveMonitored(t *testing.T, n int, monitor func(http.Handler) http.Handler,
	location func(loc, key string) string) *httptest.Server {
	t.Helper()
	var effects atomic.Int64
	hold := &holdConcurrent{n: n, answered: map[string]int{}, released: map[string]chan struct{}{}}
	mw := idempotency.New(newStore(), idempotency.WithPrincipal(principal),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)),
		idempotency.WithMonitor("/operations/", bytes.Repeat([]byte("s"), 32)))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
		r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		hold.wait(r.Header.Get("Idempotency-Key"))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"eff_%d","bytes":%d}`, effects.Add(1), len(body))
	})))
	mux.Handle("/operations/", monitor(mw.Monitor(mux)))
	outer := hold.outer(mux)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if location != nil {
			w = &relocating{ResponseWriter: w, key: r.Header.Get("Idempotency-Key"), f: location}
		}
		outer.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// relocating rewrites the Location of the answers it writes.
type relocating struct {
	http.ResponseWriter
	key string
	f   func(loc, key string) string
}

func (r *relocating) WriteHeader(status int) {
	if loc := r.Header().Get("Location"); loc != "" {
		r.Header().Set("Location", r.f(loc, r.key))
	}
	r.ResponseWriter.WriteHeader(status)
}

func check(t *testing.T, srv *httptest.Server) idemcheck.Check {
	t.Helper()
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, 4))
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	last := rep.Checks[len(rep.Checks)-1]
	require.Equal(t, "monitor", last.Name)
	return last
}

// The project's monitor passes: no key in its URLs, its completed answer
// the replay's byte for byte, nothing for a guessed identifier or another
// principal. A target without a monitor has no monitor check.
func TestMonitorCheck(t *testing.T) {
	srv := serveMonitored(t, 4, func(h http.Handler) http.Handler { return h }, nil)
	c := check(t, srv)
	require.Equal(t, idemcheck.Pass, c.Result, c.Detail)
	require.Contains(t, c.Detail, "byte for byte")
	require.Contains(t, c.Detail, "the second principal gets the same as for a guessed identifier")

	plain, _, _ := serveMiddleware(t, newStore(), 4)
	rep, err := idemcheck.Run(t.Context(), config(plain.URL, 4))
	require.NoError(t, err)
	for _, c := range rep.Checks {
		require.NotEqual(t, "monitor", c.Name)
	}
}

// Monitors that harm their clients fail the check.
func TestMonitorCheckFailures(t *testing.T) {
	for name, tc := range map[string]struct {
		monitor  func(http.Handler) http.Handler
		location func(loc, key string) string
		want     string
	}{
		"the key in the URL": {
			location: func(loc, key string) string { return "/operations/" + key },
			want:     "the monitor URL holds",
		},
		"any principal": {
			monitor: func(h http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					r.Header.Set("Authorization", "Bearer tok_1")
					h.ServeHTTP(w, r)
				})
			},
			want: "the monitor gave the second principal",
		},
		"a hint": {
			monitor: func(h http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.Header.Get("Authorization") == "Bearer tok_2" {
						owner := r.Clone(r.Context())
						owner.Header.Set("Authorization", "Bearer tok_1")
						rec := httptest.NewRecorder()
						h.ServeHTTP(rec, owner)
						if rec.Code != http.StatusNotFound {
							w.WriteHeader(http.StatusForbidden) // it exists, not yours
							return
						}
					}
					h.ServeHTTP(w, r)
				})
			},
			want: "tells another principal that the operation exists",
		},
		"another body": {
			monitor: func(h http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, r)
					w.WriteHeader(rec.Code)
					w.Write(append(rec.Body.Bytes(), '\n'))
				})
			},
			want: "gets another answer than one that retries",
		},
	} {
		t.Run(name, func(t *testing.T) {
			monitor := tc.monitor
			if monitor == nil {
				monitor = func(h http.Handler) http.Handler { return h }
			}
			c := check(t, serveMonitored(t, 4, monitor, tc.location))
			require.Equal(t, idemcheck.Fail, c.Result, c.Detail)
			require.Contains(t, c.Detail, tc.want)
		})
	}
}

// A target whose first answer is a 202 with a monitor cannot be checked:
// its answers are at the monitor, which the checker does not follow; it
// says so instead of failing checks.
func TestAcceptedTargetIsNotChecked(t *testing.T) {
	mw := idempotency.New(newStore(), idempotency.WithPrincipal(principal),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)),
		idempotency.WithMonitor("/operations/", bytes.Repeat([]byte("s"), 32)),
		idempotency.WithAcceptAfter(time.Millisecond))
	release := make(chan struct{})
	defer close(release)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
		r *http.Request) {
		<-release
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	_, err := idemcheck.Run(t.Context(), config(srv.URL, 2))
	require.ErrorContains(t, err, "its first answer is 202 Accepted with a status monitor")
}
