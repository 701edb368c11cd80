package sqlstore_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestMiddlewareAnyPathAndExactReplay drives the real middleware over each
// SQL store with paths that PostgreSQL's TEXT columns and B-tree index refuse
// (invalid UTF-8, a NUL, a 4000-byte segment), used as the route because the
// middleware wraps the handler without a mux pattern. Each must run once and
// be replayed, never answer 503; and the replay must carry a
// Content-Disposition that is not valid UTF-8 and a binary body byte for
// byte.
func TestMiddlewareAnyPathAndExactReplay(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		body := []byte{0x00, 0xff, 0xfe, 0x80, '\n', 0xe9}
		const disposition = "attachment; filename=\"r\xe9sum\xe9.pdf\""
		var runs atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header().Set("Content-Type", "application/pdf")
			w.Header().Set("Content-Disposition", disposition)
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(body)
		})
		mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
		srv := httptest.NewServer(mw.Wrap(h))
		t.Cleanup(srv.Close)

		for _, path := range []string{"/pay/%ff", "/pay/%00", "/pay/" + strings.Repeat("x", 4000)} {
			runs.Store(0)
			for i, wantReplay := range []bool{false, true} {
				req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+path, strings.NewReader(`{"a":1}`))
				require.NoError(t, err)
				req.Header.Set("Idempotency-Key", "k-any")
				req.Header.Set("Content-Type", "application/json")
				resp, err := srv.Client().Do(req)
				require.NoError(t, err)
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.NoError(t, err)
				name := path[:min(len(path), 12)]
				require.Equal(t, http.StatusCreated, resp.StatusCode, "%s request %d: %s", name, i, got)
				require.Equal(t, wantReplay, resp.Header.Get(idempotency.ReplayedHeader) == "true", "%s request %d", name, i)
				require.Equal(t, body, got, "%s request %d: body", name, i)
				require.Equal(t, []string{disposition}, resp.Header.Values("Content-Disposition"), "%s request %d", name, i)
			}
			require.EqualValues(t, 1, runs.Load(), "handler runs for %s", path[:min(len(path), 12)])
		}
	})
}

// TestScopeHashMatchesDocumentedSQL checks the package documentation's
// PostgreSQL expression for the primary key against the rows the Store
// wrote, for scopes of odd bytes and lengths.
func TestScopeHashMatchesDocumentedSQL(t *testing.T) {
	s, db := newStore(t, backends[1])
	for i, sc := range []idempotency.Scope{
		{Principal: "acct", Method: "POST", Route: "/pay/\xff", Key: "k"},
		{Principal: "", Method: "", Route: "", Key: ""},
		{Principal: "a\x00", Method: "POST", Route: strings.Repeat("r", 5000), Key: "order 42"},
	} {
		_, won, err := claimed(s.Claim(t.Context(), claimAt(sc, "o", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won, "scope %d", i)
	}
	var rows, same int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*), COUNT(*) FILTER (WHERE scope_hash =
	sha256(int8send(octet_length(principal)) || principal || int8send(octet_length(method)) || method ||
	       int8send(octet_length(route)) || route || int8send(octet_length(idem_key)) || idem_key))
	FROM `+sqlstore.DefaultTable).Scan(&rows, &same))
	require.Equal(t, 3, rows)
	require.Equal(t, 3, same)
}
