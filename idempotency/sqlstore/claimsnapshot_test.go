package sqlstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestPostgresClaimBehindATakeoverAnswersTheSuccessor: a claim whose
// statement starts while another claim's takeover of the same expired record
// is uncommitted waits for it, finds the successor's live lease and loses;
// its snapshot still holds the record as it was before the takeover (expired,
// the old owner). It must answer the successor's record, never the old one
// and never acquired: the store then reads the record again (the one case
// that costs a second statement).
func TestPostgresClaimBehindATakeoverAnswersTheSuccessor(t *testing.T) {
	ctx := t.Context()
	s, db := newStore(t, backends[1])
	rec, won, err := s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0))
	require.NoError(t, err)
	require.True(t, won)
	later := t0.Add(time.Minute) // A's lease expired

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	taken, err := sqlstore.ClaimIn(ctx, s, tx, claimAt(scope("k"), "B", "fp", later))
	require.NoError(t, err)
	require.Equal(t, "B", taken.Owner)

	one := openPGAgain(t, db, 1)
	late, err := sqlstore.Open(one, sqlstore.Postgres)
	require.NoError(t, err)
	pid := backendPID(t, one)
	done := make(chan struct{})
	var (
		got      idempotency.Record
		acquired bool
		claimErr error
	)
	go func() {
		defer close(done)
		got, acquired, claimErr = late.Claim(context.Background(), claimAt(scope("k"), "A", "fp", later))
	}()
	require.True(t, waitLockedOrDone(t, db, pid, done), "the claim waits for the takeover's row")
	require.NoError(t, tx.Commit())
	<-done
	require.NoError(t, claimErr)
	require.False(t, acquired, "the claim lost to B (its owner token equals the old owner's)")
	require.Equal(t, "B", got.Owner)
	require.Equal(t, rec.Generation+1, got.Generation)
}
