package redisstore_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// TestMiddlewareOverRedis runs the middleware over the Store: a request
// runs once and its retry is replayed byte for byte, and Run.Unit says the
// store has no transactions (errors.ErrUnsupported).
func TestMiddlewareOverRedis(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _, _ := newStore(t, b)
		runs := 0
		var unitErr error
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs++
			run, _ := idempotency.FromContext(r.Context())
			_, _, unitErr = run.Unit(r.Context())
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":"ch_1","note":"\u00e9"}`))
		})
		mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil }))
		srv := httptest.NewServer(mw.Wrap(h))
		t.Cleanup(srv.Close)
		var bodies []string
		for i := range 2 {
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":1}`))
			require.NoError(t, err)
			req.Header.Set("Idempotency-Key", "k-1")
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			require.Equal(t, http.StatusCreated, resp.StatusCode)
			require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true")
			bodies = append(bodies, string(body))
		}
		require.Equal(t, 1, runs)
		require.Equal(t, bodies[0], bodies[1])
		require.True(t, errors.Is(unitErr, errors.ErrUnsupported), "Unit: %v", unitErr)
	})
}
