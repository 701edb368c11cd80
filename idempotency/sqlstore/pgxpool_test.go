package sqlstore_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestPgxNativePool runs the store over a *sql.DB made from pgx's native
// pool with stdlib.OpenDBFromPool, as the package documentation shows for
// applications that already hold a *pgxpool.Pool: a guarded request runs
// its handler once, writes through sqlstore.Tx, and is replayed.
func TestPgxNativePool(t *testing.T) {
	pool, err := pgxpool.New(t.Context(), pgSchemaDSN(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	_, err = db.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`)
	require.NoError(t, err)

	runs := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO orders (id) VALUES ('ord_1')`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ord_1")
	})
	srv := httptest.NewServer(idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil })).Wrap(h))
	t.Cleanup(srv.Close)
	for i := range 2 {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders", strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k-pool")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode, "request %d: %s", i, body)
		require.Equal(t, "ord_1", string(body))
		require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true")
	}
	require.Equal(t, 1, runs)
	var n int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM orders`).Scan(&n))
	require.Equal(t, 1, n)
}
