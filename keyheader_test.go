package saferetry

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A key header named like one of the Transport's own headers would be
// overwritten on every attempt (WithKeyHeader("Request-Attempt") gives each
// retry a new key); one named like a field that net/http writes itself
// from the request (Host, Content-Length, ...) or that does not go end to
// end (Connection, TE, ...) never reaches the server as the key, so the
// server could not de-duplicate the retries the key allows; and one that
// is no field name cannot be sent: the Transport refuses each, failing
// every request before any I/O with an error that matches
// ErrInvalidKeyHeader, and closes its body.
func TestACollidingKeyHeaderIsRefused(t *testing.T) {
	for _, name := range []string{"Request-Attempt", "request-attempt", "REQUEST-DEADLINE-MS",
		"Request-Deadline-Ms", "Idempotency Key", "Idempotency-Key:", "Idempotency-Kéy",
		"Host", "content-length", "Transfer-Encoding", "Trailer", "Connection", "Keep-Alive",
		"Proxy-Connection", "TE", "Upgrade", "Expect"} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := &script{statuses: []int{503, 200}}
				base, url := pipeServer(t, srv)
				tr := newBubbleTransport(base, WithKeyHeader(name))
				for _, method := range []string{http.MethodPost, http.MethodGet} {
					body := &spyBody{Reader: strings.NewReader("x")}
					req, err := http.NewRequestWithContext(context.Background(), method, url, body)
					require.NoError(t, err)
					resp, err := tr.RoundTrip(req)
					assert.Nil(t, resp)
					require.ErrorIs(t, err, ErrInvalidKeyHeader)
					assert.Contains(t, err.Error(), name)
					assert.True(t, body.closed.Load(), "the request body is closed")
				}
				assert.Empty(t, srv.Hits(), "nothing is sent")
			})
		})
	}
	// Other names are the key header's.
	for _, name := range []string{"X-Request-Key", "Idempotency_Key", "Request-Attempts",
		"Request-Id"} {
		synctest.Test(t, func(t *testing.T) {
			srv := &script{statuses: []int{200}}
			base, url := pipeServer(t, srv)
			resp, err := newBubbleTransport(base, WithKeyHeader(name)).RoundTrip(
				post(t, context.Background(), url, "x"))
			require.NoError(t, err, name)
			resp.Body.Close()
			require.Len(t, srv.Hits(), 1)
			assert.NotEmpty(t, srv.Hits()[0].header.Get(name), name)
		})
	}
}
