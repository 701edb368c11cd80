package idempotency_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// A response body is copied once, from the handler into the buffer that the
// store keeps: with a declared Content-Length the buffer is that size from
// the first write (no growth: the request allocates less than 1.25 times
// the body in all), the memory store keeps it, and a replay answers from
// those very bytes.
func TestResponseBodyIsCopiedOnce(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789"), 25_000) // 250,000 bytes, not a power of two
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		for p := body; len(p) > 0; p = p[min(len(p), 4096):] {
			_, _ = w.Write(p[:min(len(p), 4096)])
		}
	})
	s := memstore.New()
	mw := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(h)
	serve := func() *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/files", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", "k")
		w := httptest.NewRecorder()
		mw.ServeHTTP(w, r)
		return w
	}
	allocated := func(f func()) float64 {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		return float64(after.TotalAlloc - before.TotalAlloc)
	}
	// What one buffer of the body's length costs (twice as much under the
	// race detector, which allocates append's argument too).
	buffer := allocated(func() { var b bytes.Buffer; b.Grow(len(body)) })
	r := httptest.NewRequest(http.MethodPost, "/files", strings.NewReader(`{}`))
	r.Header.Set("Idempotency-Key", "k")
	w := &sink{header: http.Header{}}
	require.Less(t, allocated(func() { mw.ServeHTTP(w, r) }), buffer+0.25*float64(len(body)),
		"bytes allocated by a request with a fresh key, beyond one buffer of its body")
	require.Equal(t, http.StatusOK, w.status)
	require.Equal(t, len(body), w.n)
	rec, err := s.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/files", Key: "k"})
	require.NoError(t, err)
	require.Equal(t, body, rec.Response.Body)
	again, err := s.Get(t.Context(), rec.Scope)
	require.NoError(t, err)
	require.Same(t, &rec.Response.Body[0], &again.Response.Body[0], "replays share the stored bytes")
	replay := serve()
	require.Equal(t, "true", replay.Header().Get(idempotency.ReplayedHeader))
	require.Equal(t, body, replay.Body.Bytes())
}

// sink is a ResponseWriter that keeps nothing of the body but its length.
type sink struct {
	header http.Header
	status int
	n      int
}

func (s *sink) Header() http.Header  { return s.header }
func (s *sink) WriteHeader(code int) { s.status = code }
func (s *sink) Write(p []byte) (int, error) {
	s.n += len(p)
	return len(p), nil
}
