package idempotency_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Behind deadline.Middleware, the records of an execution and of a refusal
// carry the attempt number the caller sent, so that an operator can see
// what share of the load is retries; without it, they carry none.
func TestLogsCarryTheCallersAttempt(t *testing.T) {
	log, buf := bufLogger()
	mw := idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true), idempotency.WithLogger(log))
	h := deadline.Middleware(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable) // not stored: a record of its own
	})))
	send := func(h http.Handler, attempt string) {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		if attempt != "" {
			req.Header.Set("Request-Attempt", attempt)
		}
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	send(h, "2")
	require.Contains(t, buf.String(), "attempt=2")
	buf.Reset()
	send(h, "1")
	require.Contains(t, buf.String(), "attempt=1")
	buf.Reset()
	send(h, "")
	require.NotEmpty(t, buf.String())
	assert.NotContains(t, buf.String(), "attempt=", "no attempt number sent: none logged")
	buf.Reset()
	send(mw.Wrap(http.NotFoundHandler()), "3")
	assert.NotContains(t, buf.String(), "attempt=", "no deadline.Middleware: unknown")
}
