package sqlstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// On MySQL a claim in one transaction sets the session's
// innodb_lock_wait_timeout for its INSERT and restores it after. When the
// claim's context is canceled between the two (here right after the SET),
// neither the INSERT nor the restore runs, and database/sql keeps the
// connection after rolling the transaction back: the session the pool
// hands out next must still have the timeout it had, or the user's other
// statements on that connection would wait for locks as long as the claim
// did.
func TestOneTransactionMySQLCanceledClaimRestoresLockWait(t *testing.T) {
	log := &stmtLog{}
	db := openMySQLConfig(t, mysqlDatabaseConfig(t), log)
	db.SetMaxOpenConns(1)
	s, err := sqlstore.Open(db, sqlstore.MySQL)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	lockWait := func() int {
		var n int
		require.NoError(t, db.QueryRowContext(t.Context(),
			`SELECT @@SESSION.innodb_lock_wait_timeout`).Scan(&n))
		return n
	}
	before := lockWait()
	require.NotEqual(t, 7, before)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	log.afterNext(func() { log.afterNext(cancel) }) // BEGIN, then the SET
	_, u, _, err := s.ClaimInUnit(ctx, idempotency.Claim{
		Scope:       idempotency.Scope{Principal: "p", Method: "POST", Route: "/r", Key: "k"},
		Fingerprint: "fp", FingerprintVersion: 1, Owner: "o", Now: time.Now(),
		LeaseFor: time.Minute, ReplayWindow: time.Hour,
	}, 7*time.Second)
	require.ErrorIs(t, err, context.Canceled)
	require.Nil(t, u)
	require.Equal(t, before, lockWait(), "the pooled session keeps its lock wait")
	require.Zero(t, db.Stats().InUse)
}
