package sqlstore_test

import (
	"context"
	"database/sql"
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
	rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	later := t0.Add(time.Minute) // A's lease expired

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	taken, err := sqlstore.ClaimIn(ctx, s, tx, claimAt(scope("k"), "B", "fp", later))
	require.NoError(t, err)
	require.Equal(t, "B", taken.Owner)

	got, acquired := claimBehind(t, s, db, claimAt(scope("k"), "A", "fp", later), tx.Commit)
	require.False(t, acquired, "the claim lost to B (its owner token equals the old owner's)")
	require.Equal(t, "B", got.Owner)
	require.Equal(t, rec.Generation+1, got.Generation)
}

// claimBehind runs c on a connection of its own while another transaction
// holds the record's row, waits until the claim waits for that row's lock,
// calls commit (which ends that transaction), and returns what the claim
// answered.
func claimBehind(t *testing.T, s *sqlstore.Store, db *sql.DB, c idempotency.Claim, commit func() error) (idempotency.Record, bool) {
	t.Helper()
	one := openPGAgain(t, db, 1)
	late, err := sqlstore.Open(one, sqlstore.Postgres, sqlstore.WithTable(sqlstore.DefaultTable))
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
		got, acquired, claimErr = claimed(late.Claim(context.Background(), c))
	}()
	require.True(t, waitLockedOrDone(t, db, pid, done), "the claim waits for the row")
	require.NoError(t, commit())
	<-done
	require.NoError(t, claimErr)
	return got, acquired
}

// On PostgreSQL the claim's statement reads the record it did not win as of
// its own snapshot unless it locks it: a claim that waited behind another
// transaction's write must answer the record as that transaction left it.

// A's record (fingerprint X, live lease) is deleted and B claims the key
// with fingerprint Y, in one transaction that commits after C's claim
// began. C (fingerprint Y) must see B's record (same fingerprint: in
// progress), never A's, which no longer exists (a 422 for a request that
// matches the live record).
func TestPostgresLosingClaimSeesTheRecordItWaitedFor(t *testing.T) {
	ctx := t.Context()
	s, db := newStore(t, backends[1])
	_, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fpX", t0)))
	require.NoError(t, err)
	require.True(t, won)
	now := t0.Add(time.Second) // A's lease still live

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.ExecContext(ctx, "DELETE FROM idempotency_records")
	require.NoError(t, err)
	b, err := sqlstore.ClaimIn(ctx, s, tx, claimAt(scope("k"), "B", "fpY", now))
	require.NoError(t, err)
	require.Equal(t, "B", b.Owner)

	got, acquired := claimBehind(t, s, db, claimAt(scope("k"), "C", "fpY", now), tx.Commit)
	require.False(t, acquired)
	require.Equal(t, "B", got.Owner)
	require.Equal(t, "fpY", got.Fingerprint)
}

// A duplicate claim that waits behind a unit whose completion is written
// but not yet committed answers the completed record (a replay), not the
// in-progress one its snapshot saw.
func TestPostgresLosingClaimBehindACompletionSeesItCompleted(t *testing.T) {
	ctx := t.Context()
	s, db := newStore(t, backends[1])
	a, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	u, _, err := s.Begin(ctx, a.Lease())
	require.NoError(t, err)
	require.NoError(t, u.Complete(ctx, idempotency.Response{Status: 201, Body: []byte("done")}, t0))
	got, _ := claimBehind(t, s, db, claimAt(scope("k"), "C", "fp", t0.Add(time.Second)), u.Commit)
	require.Equal(t, idempotency.Completed, got.State)
	require.Equal(t, []byte("done"), got.Response.Body)
}
