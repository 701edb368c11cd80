package sqlstore_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A handler that holds its unit (and so, on SQLite, the write lock) while a
// heartbeat comes due must not be stalled or failed by that heartbeat: the
// beat waits behind the handler's own lock, and neither stopping it nor its
// failure may cost the request its completion.
func TestHeartbeatBehindTheHandlersOwnUnit(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, ok := sqlstore.Tx(r.Context())
			if !ok {
				http.Error(w, "no transaction", http.StatusInternalServerError)
				return
			}
			if _, err := tx.ExecContext(r.Context(),
				`INSERT INTO orders (id, amount, customer) VALUES ($1, 100, $2)`, "ord_hb", "cus_1"); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			time.Sleep(150 * time.Millisecond) // past the first heartbeat (lease/3 = 100 ms)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, `{"order":"ord_hb"}`)
		})
		mw := idempotency.New(s, idempotency.WithLease(300*time.Millisecond),
			idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
		mux := http.NewServeMux()
		mux.Handle("POST /orders", mw.Wrap(h))
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)

		start := time.Now()
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k-hb")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		require.Less(t, time.Since(start), 3*time.Second, "not stalled behind its own lock for the busy timeout")
		require.True(t, hasOrder(t, db, "ord_hb"))
		var state int
		require.NoError(t, db.QueryRow(`SELECT state FROM `+sqlstore.DefaultTable+` WHERE idem_key = $1`, []byte("k-hb")).Scan(&state))
		require.Equal(t, int(idempotency.Completed), state)
	})
}
