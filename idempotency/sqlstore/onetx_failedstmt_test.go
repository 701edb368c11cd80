package sqlstore_test

import (
	"context"
	"database/sql"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A handler whose statement fails in the request's transaction (a unique
// violation) and that answers a stored status (400): on SQLite and MySQL
// the transaction goes on and the answer is stored with the claim; on
// PostgreSQL the failed statement aborts the transaction, so nothing can
// commit, the request answers 503 CodeStoreUnavailable and leaves nothing,
// every time, unless the statement ran in a SAVEPOINT rolled back to on
// error (as sqlstore.Tx's documentation says), after which the answer is
// stored.
func TestOneTransactionFailedStatement(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		_, err := db.Exec(`CREATE TABLE onetx_taken (id VARCHAR(200) PRIMARY KEY)`)
		require.NoError(t, err)
		_, err = db.Exec(`INSERT INTO onetx_taken (id) VALUES ('taken')`)
		require.NoError(t, err)
		savepoint := false
		hook := func(ctx context.Context, tx *sql.Tx) {
			if savepoint {
				if _, err := tx.ExecContext(ctx, `SAVEPOINT taken`); err != nil {
					t.Errorf("savepoint: %v", err) // off the test's goroutine
				}
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO onetx_taken (id) VALUES ('taken')`)
			if err != nil && savepoint {
				if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT taken`); err != nil {
					t.Errorf("rollback to savepoint: %v", err)
				}
			}
		}
		srv, runs := oneTxServer(t, s, db, hook)

		first := oneTxPost(t, srv, "?status=400", "k1")
		if b.dialect != sqlstore.Postgres {
			require.Equal(t, http.StatusBadRequest, first.status, first.body)
			again := oneTxPost(t, srv, "?status=400", "k1")
			require.True(t, again.replayed)
			require.EqualValues(t, 1, runs.Load())
			return
		}
		require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
		require.Contains(t, first.body, string(idempotency.CodeStoreUnavailable))
		orders, records := oneTxCounts(t, db, "k1")
		require.Equal(t, [2]int{0, 0}, [2]int{orders, records}, "nothing committed")

		savepoint = true
		retry := oneTxPost(t, srv, "?status=400", "k1")
		require.Equal(t, http.StatusBadRequest, retry.status, retry.body)
		again := oneTxPost(t, srv, "?status=400", "k1")
		require.True(t, again.replayed)
		require.EqualValues(t, 2, runs.Load())
		orders, records = oneTxCounts(t, db, "k1")
		require.Equal(t, [2]int{1, 1}, [2]int{orders, records})
	})
}
