package idemcheck_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
)

func TestTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now
	rep, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: "http://" + addr + "/payments"})
	require.ErrorContains(t, err, "could not be checked: no answer to the first request")
	require.ErrorContains(t, err, "connection refused")
	require.Empty(t, rep.Checks)
}

func TestTargetAnswers404(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	_, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: srv.URL + "/nowhere"})
	require.ErrorContains(t, err, "its first answer is 404 Not Found, not a success (2xx)")
	require.ErrorContains(t, err, "404 page not found")
}

func TestFirstAnswerWithoutIDField(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"charge":"ch_1"}`))
	}))
	defer srv.Close()
	_, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: srv.URL, IDField: "id"})
	require.ErrorContains(t, err, `its first answer has no JSON member "id"`)
}

func TestBadConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  idemcheck.Config
		want string
	}{
		{idemcheck.Config{}, "bad URL"},
		{idemcheck.Config{URL: "ftp://example.com/"}, "want http:// or https://"},
		{idemcheck.Config{URL: "http://127.0.0.1/", N: 257}, "N 257 is above 256"},
		{idemcheck.Config{URL: "http://127.0.0.1/", Method: "PO ST"}, "bad method"},
		{idemcheck.Config{URL: "http://127.0.0.1/", KeyHeader: "Key:"}, "bad key header name"},
		{idemcheck.Config{URL: "http://127.0.0.1/",
			Header: http.Header{"Idempotency-Key": {"k"}}}, "the checker sets the key itself"},
		{idemcheck.Config{URL: "http://127.0.0.1/",
			Other: http.Header{"Idempotency-Key": {"k"}}}, "the checker sets the key itself"},
	} {
		_, err := idemcheck.Run(t.Context(), tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
}

// hang answers nothing until the test ends.
func hang(done <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-done:
		case <-r.Context().Done():
		}
	})
}

func TestEveryRequestIsBounded(t *testing.T) {
	done := make(chan struct{})
	srv := httptest.NewServer(hang(done))
	defer srv.Close()
	defer close(done)
	start := time.Now()
	_, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: srv.URL, Timeout: 50 * time.Millisecond})
	require.ErrorContains(t, err, "no answer to the first request")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 5*time.Second)
}

// A target that hangs on duplicates fails the concurrent check; the run
// goes on, and in_progress sees no conflict in its bursts.
func TestHangOnDuplicatesFailsConcurrent(t *testing.T) {
	done := make(chan struct{})
	srv, _ := serveFake(t, correct, 4)
	hanging := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if key := r.Header.Get("Idempotency-Key"); strings.HasPrefix(key, "idemcheck-concurrent-") ||
			strings.HasPrefix(key, "idemcheck-in_progress-") {
			hang(done).ServeHTTP(w, r)
			return
		}
		proxyTo(srv.URL).ServeHTTP(w, r)
	}))
	defer hanging.Close()
	defer close(done)
	cfg := config(hanging.URL, 4)
	cfg.Timeout = 100 * time.Millisecond
	rep, err := idemcheck.Run(t.Context(), cfg)
	require.NoError(t, err)
	require.Equal(t, idemcheck.Fail, results(rep)["concurrent"], rep.String())
	require.Contains(t, rep.Checks[1].Detail, "gets no answer and cannot tell whether its request took effect")
	require.Equal(t, idemcheck.Skip, results(rep)["in_progress"])
}

// proxyTo forwards a request to base and copies the answer back.
func proxyTo(base string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, base+r.URL.Path, r.Body)
		req.Header = r.Header.Clone()
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	})
}

func TestAnswerBodyIsBounded(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := []byte(strings.Repeat("x", 64<<10))
		for range 32 { // 2 MiB, over the 1 MiB the checker reads
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	defer srv.Close()
	_, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: srv.URL})
	require.ErrorContains(t, err, "200 with a body over 1048576 bytes")
}

func TestRunIsBoundedByItsContext(t *testing.T) {
	done := make(chan struct{})
	srv, _ := serveFake(t, correct, 2)
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.Header.Get("Idempotency-Key"), "idemcheck-concurrent-") {
			hang(done).ServeHTTP(w, r)
			return
		}
		proxyTo(srv.URL).ServeHTTP(w, r)
	}))
	defer slow.Close()
	defer close(done)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	rep, err := idemcheck.Run(ctx, config(slow.URL, 2)) // Timeout 10 s: the context ends first
	require.ErrorContains(t, err, "the run was cut short during the concurrent check")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Len(t, rep.Checks, 2, "the report holds the checks run so far")
}

func TestBadHeaders(t *testing.T) {
	for _, h := range []http.Header{
		{"Bad Name": {"x"}},
		{"X-Line": {"a\r\nInjected: 1"}},
		{"X-Nul": {"a\x00"}},
	} {
		_, err := idemcheck.Run(t.Context(), idemcheck.Config{URL: "http://127.0.0.1/", Header: h})
		require.ErrorContains(t, err, "idemcheck: ")
		_, err = idemcheck.Run(t.Context(), idemcheck.Config{URL: "http://127.0.0.1/", Other: h})
		require.ErrorContains(t, err, "idemcheck: ")
	}
}
