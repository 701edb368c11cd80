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
// is uncommitted would win the record as its snapshot holds it (expired,
// the old owner), so it waits for the takeover, then finds the successor's
// live lease and loses. It must answer the successor's record, never the
// old one and never acquired: the store then reads the record again (the
// one case that costs a second statement).
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

	got, acquired := claimBehind(t, db, claimAt(scope("k"), "A", "fp", later), tx.Commit)
	require.False(t, acquired, "the claim lost to B (its owner token equals the old owner's)")
	require.Equal(t, "B", got.Owner)
	require.Equal(t, rec.Generation+1, got.Generation)
}

// TestPostgresClaimBehindAnInsertOfAnEndedLeaseTakesItOver: a claim whose
// statement starts while another transaction has inserted the key's record
// (and ended its lease) but not committed finds no row in its snapshot, so
// its INSERT waits for that transaction and then does nothing: the
// statement returns no row, and the claim reads the record. That record,
// committed after the statement began, is one the claim wins (its lease
// ended): the claim takes it over, never answers it as an existing record.
func TestPostgresClaimBehindAnInsertOfAnEndedLeaseTakesItOver(t *testing.T) {
	ctx := t.Context()
	s, db := newStore(t, backends[1])
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	a, err := sqlstore.ClaimIn(ctx, s, tx, claimAt(scope("k"), "A", "fp", t0))
	require.NoError(t, err)
	require.NoError(t, sqlstore.HeartbeatIn(ctx, s, tx, a.Lease(), t0)) // ends the lease
	got, acquired := claimBehind(t, db, claimAt(scope("k"), "B", "fp", t0.Add(time.Second)),
		tx.Commit)
	require.True(t, acquired, "the claim answered the ended lease it wins: %+v", got)
	require.Equal(t, "B", got.Owner)
	require.Equal(t, a.Generation+1, got.Generation)
}

// claimBehind runs c on a connection of its own while another transaction
// holds the record's row, waits until the claim waits for that row's lock,
// calls commit (which ends that transaction), and returns what the claim
// answered.
func claimBehind(t *testing.T, db *sql.DB, c idempotency.Claim, commit func() error) (idempotency.Record, bool) {
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

// A claim that would not win the record as its statement's snapshot holds
// it never waits for another transaction: it answers the record as last
// committed, a state that held while it ran, and the next claim after the
// other transaction commits answers what that one left.

// A's record (fingerprint X, live lease) is deleted and B claims the key
// with fingerprint Y, in one transaction still open while C (fingerprint
// Y) claims: C answers A's record at once (the record then committed; the
// middleware's 422), and after the commit B's (in progress).
func TestPostgresLosingClaimAnswersTheCommittedRecordWithoutWaiting(t *testing.T) {
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

	got, acquired := claimNoWait(t, s, claimAt(scope("k"), "C", "fpY", now))
	require.False(t, acquired)
	require.Equal(t, "A", got.Owner)
	require.Equal(t, "fpX", got.Fingerprint)
	require.NoError(t, tx.Commit())
	got, acquired = claimNoWait(t, s, claimAt(scope("k"), "C", "fpY", now))
	require.False(t, acquired)
	require.Equal(t, "B", got.Owner)
	require.Equal(t, "fpY", got.Fingerprint)
}

// A duplicate claim while a unit's completion is written (the row locked
// and changed) but not yet committed answers the record in progress (a
// 409) at once, not waiting for the unit, and the replay once the unit
// commits.
func TestPostgresLosingClaimBehindACompletionAnswersInProgressThenCompleted(t *testing.T) {
	ctx := t.Context()
	s, _ := newStore(t, backends[1])
	a, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	u, uctx, err := s.Begin(ctx, a.Lease())
	require.NoError(t, err)
	defer func() { _ = u.Rollback() }()
	_, began := sqlstore.Tx(uctx) // the unit's transaction writes the completion at once
	require.True(t, began)
	require.NoError(t, u.Complete(ctx, idempotency.Response{Status: 201, Body: []byte("done")}, t0))
	got, acquired := claimNoWait(t, s, claimAt(scope("k"), "C", "fp", t0.Add(time.Second)))
	require.False(t, acquired)
	require.Equal(t, idempotency.InProgress, got.State)
	require.Equal(t, "A", got.Owner)
	require.NoError(t, u.Commit())
	got, _ = claimNoWait(t, s, claimAt(scope("k"), "C", "fp", t0.Add(time.Second)))
	require.Equal(t, idempotency.Completed, got.State)
	require.Equal(t, []byte("done"), got.Response.Body)
}

// claimNoWait runs c with a bound: a claim that waited for the other
// transaction, which the test commits only after it returns, would hit it.
func claimNoWait(t *testing.T, s *sqlstore.Store, c idempotency.Claim) (idempotency.Record, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	got, acquired, err := claimed(s.Claim(ctx, c))
	require.NoError(t, err, "the claim waited for the open transaction")
	return got, acquired
}
