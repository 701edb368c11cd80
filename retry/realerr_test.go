package retry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// roundTrip sends method to u through a fresh transport and returns the
// error, wrapped in *url.Error as an http.Client would (wrapClient) or raw
// as a RoundTripper sees it.
func roundTrip(t *testing.T, ctx context.Context, tr *http.Transport, method, u string, wrapClient bool) error {
	t.Helper()
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	require.NoError(t, err)
	var resp *http.Response
	if wrapClient {
		resp, err = (&http.Client{Transport: tr}).Do(req)
	} else {
		resp, err = tr.RoundTrip(req)
	}
	if resp != nil {
		resp.Body.Close()
	}
	require.Error(t, err)
	return err
}

// closedPort returns an address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// rawServer accepts connections, reads one request head, then calls act.
func rawServer(t *testing.T, act func(c *net.TCPConn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 4096)
				_, _ = c.Read(buf) // the request head (small, one read on loopback)
				act(c.(*net.TCPConn))
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	return "http://" + ln.Addr().String() + "/"
}

func TestClassifyRealConnRefused(t *testing.T) {
	u := "http://" + closedPort(t) + "/"
	for _, wrap := range []bool{false, true} {
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			err := roundTrip(t, context.Background(), &http.Transport{}, method, u, wrap)
			require.ErrorIs(t, err, syscall.ECONNREFUSED)
			if wrap {
				var ue *url.Error
				require.ErrorAs(t, err, &ue)
			}
			d := Classify(nil, Input{Idempotent: method == http.MethodGet, Err: err}, time.Now())
			require.Equal(t, Decision{Retry: true, Class: ClassConnRefused, NeverSent: true}, d, "method %s wrap %v: %v", method, wrap, err)

			// The exhausted error keeps the root cause reachable through every wrapper.
			ex := error(&ExhaustedError{Attempts: 3, Reason: ReasonMaxAttempts, Err: err})
			require.ErrorIs(t, ex, ErrExhausted)
			require.ErrorIs(t, ex, syscall.ECONNREFUSED)
			var op *net.OpError
			require.ErrorAs(t, ex, &op)
			require.Equal(t, "dial", op.Op)
			require.Contains(t, ex.Error(), "saferetry: gave up after 3 attempts (max_attempts): ")
			require.Contains(t, ex.Error(), "connection refused")
		}
	}
}

func TestClassifyRealConnReset(t *testing.T) {
	u := rawServer(t, func(c *net.TCPConn) {
		_ = c.SetLinger(0) // close with RST
		c.Close()
	})
	err := roundTrip(t, context.Background(), &http.Transport{}, http.MethodPost, u, true)
	require.ErrorIs(t, err, syscall.ECONNRESET, "%v", err)
	require.Equal(t, Decision{Retry: true, Class: ClassConnReset},
		Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))
	require.Equal(t, Decision{Retry: false, Class: ClassConnReset},
		Classify(nil, Input{Idempotent: false, Err: err}, time.Now()),
		"a reset after the request was written is never retried without idempotency")
}

func TestClassifyRealEOF(t *testing.T) {
	u := rawServer(t, func(c *net.TCPConn) { c.Close() }) // FIN without a response
	err := roundTrip(t, context.Background(), &http.Transport{}, http.MethodPost, u, false)
	require.ErrorIs(t, err, io.EOF, "%v", err)
	require.Equal(t, Decision{Retry: true, Class: ClassEOF},
		Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))
	require.Equal(t, Decision{Class: ClassEOF},
		Classify(nil, Input{Idempotent: false, Err: err}, time.Now()))
}

func TestClassifyRealTLSUntrusted(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the rejected handshakes are expected
	srv.StartTLS()
	defer srv.Close()
	for _, wrap := range []bool{false, true} {
		err := roundTrip(t, context.Background(), &http.Transport{}, http.MethodGet, srv.URL, wrap)
		var ua x509.UnknownAuthorityError
		require.ErrorAs(t, err, &ua, "%v", err)
		var cv *tls.CertificateVerificationError
		require.ErrorAs(t, err, &cv)
		require.Equal(t, Decision{Class: ClassTLS}, Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))
	}

	// Trusted CA but the wrong name: a HostnameError.
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "not-in-the-cert.invalid"}}
	err := roundTrip(t, context.Background(), tr, http.MethodGet, srv.URL, true)
	var he x509.HostnameError
	require.ErrorAs(t, err, &he, "%v", err)
	require.Equal(t, Decision{Class: ClassTLS}, Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))
}

func TestClassifyRealAttemptTimeout(t *testing.T) {
	release := make(chan struct{})
	u := rawServer(t, func(c *net.TCPConn) {
		<-release // never answers until the test ends
		c.Close()
	})
	defer close(release)

	parent := context.Background()
	attemptCtx, cancel := context.WithTimeout(parent, 20*time.Millisecond)
	defer cancel()
	err := roundTrip(t, attemptCtx, &http.Transport{}, http.MethodGet, u, false)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	timedOut := parent.Err() == nil && errors.Is(attemptCtx.Err(), context.DeadlineExceeded)
	require.True(t, timedOut)
	require.Equal(t, Decision{Retry: true, Class: ClassTimeout},
		Classify(nil, Input{Idempotent: true, Err: err, AttemptTimedOut: true}, time.Now()))
	require.Equal(t, Decision{Class: ClassTimeout},
		Classify(nil, Input{Idempotent: false, Err: err, AttemptTimedOut: true}, time.Now()),
		"a timeout is never retried for an unsafe request")
	// The same error from the caller's own deadline is final.
	require.Equal(t, Decision{Class: ClassCallerDeadline},
		Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))

	// A transport-level timeout (ResponseHeaderTimeout) is a per-attempt timeout too.
	err = roundTrip(t, context.Background(), &http.Transport{ResponseHeaderTimeout: 20 * time.Millisecond}, http.MethodGet, u, true)
	require.Equal(t, Decision{Retry: true, Class: ClassTimeout},
		Classify(nil, Input{Idempotent: true, Err: err}, time.Now()), "%v", err)
}

func TestClassifyRealCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	u := rawServer(t, func(c *net.TCPConn) { c.Close() })
	err := roundTrip(t, ctx, &http.Transport{}, http.MethodGet, u, true)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, Decision{Class: ClassCanceled}, Classify(nil, Input{Idempotent: true, Err: err}, time.Now()))
}

func TestClassifyRealStatuses(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/429":
			w.Header().Set("Retry-After", "7")
			w.WriteHeader(http.StatusTooManyRequests)
		case "/503-date":
			w.Header().Set("Retry-After", now.Add(90*time.Second).Format(http.TimeFormat))
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/503":
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	}))
	defer srv.Close()
	get := func(path string) *http.Response {
		resp, err := srv.Client().Get(srv.URL + path)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	require.Equal(t, Decision{Retry: true, Class: "status_429", Throttle: true, RetryAfter: 7 * time.Second, HasRetryAfter: true},
		Classify(nil, Input{Idempotent: true, Response: get("/429")}, now))
	require.Equal(t, Decision{Retry: true, Class: "status_503", Throttle: true, RetryAfter: 90 * time.Second, HasRetryAfter: true},
		Classify(nil, Input{Idempotent: true, Response: get("/503-date")}, now))
	require.Equal(t, Decision{Retry: true, Class: "status_503"},
		Classify(nil, Input{Idempotent: true, Response: get("/503")}, now))
	require.Equal(t, Decision{Class: "status_404"},
		Classify(nil, Input{Idempotent: true, Response: get("/404")}, now))
}
