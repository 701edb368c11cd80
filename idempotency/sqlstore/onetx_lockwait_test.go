package sqlstore_test

import (
	"context"
	"database/sql"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A claim in one transaction bounds its lock wait (PostgreSQL's
// lock_timeout, MySQL's innodb_lock_wait_timeout) and leaves every
// connection's as it was: in the handler's transaction after a claim with
// the largest wait, and on the pooled connection after a claim that ran
// out of its wait (the floor, for a wait of 0) or was canceled while it
// waited.
func TestOneTransactionClaimLeavesTheLockWait(t *testing.T) {
	// Not on SQLite: it waits for its busy timeout, which the claim does not set.
	forEachServer(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		db.SetMaxOpenConns(2)
		query := `SHOW lock_timeout`
		if b.dialect == sqlstore.MySQL {
			query = `SELECT @@SESSION.innodb_lock_wait_timeout`
		}
		read := func(q interface {
			QueryRowContext(context.Context, string, ...any) *sql.Row
		}) string {
			var v string
			require.NoError(t, q.QueryRowContext(t.Context(), query).Scan(&v))
			return v
		}
		base := read(db)
		claim := idempotency.Claim{
			Scope:       idempotency.Scope{Principal: "p", Method: "POST", Route: "/r", Key: "k"},
			Fingerprint: "fp", FingerprintVersion: 1, Owner: "first", Now: time.Now(),
			LeaseFor: time.Minute, ReplayWindow: time.Hour,
		}

		res, u, uctx, err := s.ClaimInUnit(t.Context(), claim, time.Duration(math.MaxInt64))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, res.Outcome)
		tx, ok := sqlstore.Tx(uctx)
		require.True(t, ok)
		require.Equal(t, base, read(tx), "the handler's statements wait as the session does")

		claim.Owner = "second"
		_, u2, _, err := s.ClaimInUnit(t.Context(), claim, 0)
		require.ErrorIs(t, err, idempotency.ErrInProgress)
		require.Nil(t, u2)
		require.Equal(t, base, read(db), "after a claim that ran out of its wait")

		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		_, u3, _, err := s.ClaimInUnit(ctx, claim, time.Minute)
		require.Error(t, err)
		require.Nil(t, u3)
		require.Equal(t, base, read(db), "after a claim canceled while it waited")

		require.NoError(t, u.Rollback())
		c1, err := db.Conn(t.Context())
		require.NoError(t, err)
		defer c1.Close()
		c2, err := db.Conn(t.Context())
		require.NoError(t, err)
		defer c2.Close()
		require.Equal(t, [2]string{base, base}, [2]string{read(c1), read(c2)})
		require.NoError(t, c1.Close())
		require.NoError(t, c2.Close())
		require.Zero(t, db.Stats().InUse)
	})
}
