//go:build unix

package sqlstore_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A request on a route that commits in one transaction: the claim's INSERT
// runs in the open transaction and its connection dies before the answer
// (PostgreSQL: a proxy cuts it once the server answered; MySQL: the
// driver's socket is closed; SQLite: the driver reports the loss and the
// pool discards the connection). Nothing committed: the request answers
// 503 without running the handler, and leaves no record; the retry runs
// once and is replayed after.
func TestOneTransactionClaimWhoseAnswerIsLost(t *testing.T) {
	for _, tc := range claimCuts() {
		t.Run(tc.name, func(t *testing.T) {
			db, arm, cuts := tc.open(t)
			s, err := sqlstore.Open(db, tc.dialect)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			_, err = db.ExecContext(t.Context(), `CREATE TABLE payments (id VARCHAR(64) PRIMARY KEY)`)
			require.NoError(t, err)
			var runs atomic.Int32
			mw := idempotency.New(s, idempotency.WithOneTransaction(true),
				idempotency.WithAnonymousKeys(true), idempotency.WithLogger(slog.New(slog.DiscardHandler)))
			srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
				r *http.Request) {
				n := runs.Add(1)
				tx, ok := sqlstore.Tx(r.Context())
				if !ok {
					http.Error(w, "no transaction", http.StatusInternalServerError)
					return
				}
				if _, err := tx.ExecContext(r.Context(), "INSERT INTO payments (id) VALUES ('pay_"+
					fmt.Sprint(n)+"')"); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"payment":%d}`, n)
			})))
			t.Cleanup(srv.Close)

			arm()
			first := post(t, srv, "", "k-onetx-claim", "pay")
			require.EqualValues(t, 1, cuts(), "the claim's answer was lost")
			require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
			require.Contains(t, first.body, string(idempotency.CodeStoreUnavailable))
			require.Zero(t, runs.Load(), "the handler did not run")
			require.Zero(t, countRecords(t, db, "k-onetx-claim"), "nothing committed")

			retry := post(t, srv, "", "k-onetx-claim", "pay")
			require.Equal(t, http.StatusCreated, retry.status, retry.body)
			require.False(t, retry.replayed)
			again := post(t, srv, "", "k-onetx-claim", "pay")
			require.True(t, again.replayed)
			require.Equal(t, retry.body, again.body)
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, 1, countPayments(t, db))
			require.Zero(t, db.Stats().InUse)
		})
	}
}
