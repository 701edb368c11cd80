package idempotency_test

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// rawPost sends one POST /payments with key over a new TCP connection, as
// bytes, and reads the answer (or EOF if the server closed the connection
// without one).
func rawPost(t *testing.T, addr, key string) (*http.Response, string, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(timeout)))
	_, err = io.WriteString(conn, "POST /payments HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer test-client\r\nIdempotency-Key: "+key+
		"\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(b), nil
}

// A guarded handler cannot hijack its connection: the hijack fails with
// an error wrapping http.ErrNotSupported (through http.ResponseController
// as through a type assertion), so the handler answers over HTTP as usual,
// and nothing is stored for an answer that the middleware never sent (an
// empty 200 that a retry would get replayed).
func TestHijackOnAGuardedRouteFails(t *testing.T) {
	var mu sync.Mutex
	var hijacked int
	var errs []error
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var err error
		if hj, ok := w.(http.Hijacker); ok {
			_, _, err = hj.Hijack()
		} else {
			err = errors.New("the writer is not an http.Hijacker")
		}
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			http.Error(w, "cannot take the connection over: "+err.Error(), http.StatusInternalServerError)
			return
		}
		mu.Lock()
		hijacked++
		mu.Unlock()
		_, _ = buf.WriteString("HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		_ = buf.Flush()
		_ = conn.Close()
	})
	srv := serve(t, memstore.New(), next)
	addr := strings.TrimPrefix(srv.URL, "http://")

	for attempt := 1; attempt <= 2; attempt++ {
		resp, body, err := rawPost(t, addr, "hijack-1")
		require.NoError(t, err, "attempt %d", attempt)
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode, "attempt %d: %s", attempt, body)
		require.Contains(t, body, "cannot be hijacked")
		require.Empty(t, resp.Header.Get(idempotency.ReplayedHeader), "attempt %d: nothing was stored", attempt)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, hijacked)
	require.Len(t, errs, 2, "the handler ran on both attempts: its 500 released the key")
	for _, err := range errs {
		require.ErrorIs(t, err, http.ErrNotSupported, "a type assertion to http.Hijacker refuses too")
	}
}
