package idempotency_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

// The keys real clients send (stripe-go sends any key of up to 255
// characters after trimming spaces) are accepted end to end, by the
// saferetry Transport and by the middleware, and replayed under the same
// key; what the rule refuses is refused by both, with the typed errors.
func TestKeysRealClientsSend(t *testing.T) {
	var effects atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := effects.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, n)
	})
	srv := serve(t, memstore.New(), h)
	client := &http.Client{Transport: saferetry.NewTransport(nil,
		saferetry.WithBudget(budget.Unlimited()), saferetry.WithLogger(quiet))}
	t.Cleanup(client.CloseIdleConnections)
	send := func(header string) (*http.Response, string, error) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":1}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer alice")
		req.Header["Idempotency-Key"] = []string{header}
		resp, err := client.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, string(b), nil
	}

	for _, tc := range []struct{ name, header, again string }{
		{"inner space", "order 42", " order 42 "},
		{"comma, bare", "invoice,2024-7", `"invoice,2024-7"`},
		{"quote and backslash, bare", `a"b\c`, `"a\"b\\c"`},
		{"255 bytes", strings.Repeat("k", 254) + "!", strings.Repeat("k", 254) + "!"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := effects.Load()
			first, body, err := send(tc.header)
			require.NoError(t, err)
			require.Equal(t, http.StatusCreated, first.StatusCode, body)
			require.Empty(t, first.Header.Get(idempotency.ReplayedHeader))
			// The same key, sent the same way and then written another way
			// (outer spaces, an sf-string): both replay the first answer.
			for _, again := range []string{tc.header, tc.again} {
				resp, b, err := send(again)
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, resp.StatusCode, b)
				require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader), "%q", again)
				require.Equal(t, body, b)
			}
			require.Equal(t, before+1, effects.Load(), "the work ran once")
		})
	}

	for _, tc := range []struct{ name, header, reason string }{
		{"control character", "order\x0142", "invalid_char"},
		{"tab inside", "order\t42", "invalid_char"},
		{"non-ASCII", "caf\u00e9", "invalid_char"},
		{"256 bytes", strings.Repeat("k", 256), "too_long"},
		{"malformed sf-string", `"a\qb"`, "malformed_string"},
	} {
		t.Run("refused/"+tc.name, func(t *testing.T) {
			before := effects.Load()
			// The Transport refuses it before any network I/O.
			_, _, err := send(tc.header)
			require.ErrorIs(t, err, keygen.ErrInvalidKey)
			var ike *keygen.InvalidKeyError
			require.True(t, errors.As(err, &ike), "%v", err)
			require.Equal(t, tc.reason, ike.Reason)
			// The middleware refuses it too (sent without the Transport;
			// net/http's server itself refuses a control character in a
			// header, so that case goes straight to the middleware).
			var a answer
			if strings.Contains(tc.header, "\x01") {
				a = direct(t, srv.Config.Handler, tc.header)
			} else {
				a = post(t, srv, tc.header, `{"amount":1}`, "Authorization: Bearer alice")
			}
			p := requireProblem(t, a, http.StatusBadRequest, idempotency.CodeKeyInvalid)
			require.Contains(t, p.Detail, tc.reason)
			require.Equal(t, before, effects.Load(), "nothing ran")
		})
	}

	t.Run("refused/two field lines", func(t *testing.T) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header["Idempotency-Key"] = []string{"k1", "k1"}
		_, err = client.Do(req)
		require.ErrorIs(t, err, keygen.ErrInvalidKey)
		a := post(t, srv, "k1", `{}`, "Idempotency-Key: k1", "Authorization: Bearer alice")
		requireProblem(t, a, http.StatusBadRequest, idempotency.CodeKeyInvalid)
	})
}

// direct serves one guarded request with key header value v through h in
// process, without a network (for values net/http refuses to send).
func direct(t *testing.T, h http.Handler, v string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, "http://payments.test/payments", strings.NewReader(`{"amount":1}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer alice")
	req.Header["Idempotency-Key"] = []string{v}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return answer{rec.Code, rec.Header(), rec.Body.String()}
}
