package sqlstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

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
	_, won, err := s.Claim(ctx, claimAt(scope("k"), "A", "fpX", t0))
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
		got, acquired, claimErr = late.Claim(context.Background(), claimAt(scope("k"), "C", "fpY", now))
	}()
	require.True(t, waitLockedOrDone(t, db, pid, done))
	require.NoError(t, tx.Commit())
	<-done
	require.NoError(t, claimErr)
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
	a, _, err := s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0))
	require.NoError(t, err)
	u, _, err := s.Begin(ctx, a.Lease())
	require.NoError(t, err)
	require.NoError(t, u.Complete(ctx, idempotency.Response{Status: 201, Body: []byte("done")}, t0))
	one := openPGAgain(t, db, 1)
	late, err := sqlstore.Open(one, sqlstore.Postgres)
	require.NoError(t, err)
	pid := backendPID(t, one)
	done := make(chan struct{})
	var got idempotency.Record
	var cerr error
	go func() {
		defer close(done)
		got, _, cerr = late.Claim(context.Background(), claimAt(scope("k"), "C", "fp", t0.Add(time.Second)))
	}()
	require.True(t, waitLockedOrDone(t, db, pid, done))
	require.NoError(t, u.Commit())
	<-done
	require.NoError(t, cerr)
	require.Equal(t, idempotency.Completed, got.State)
	require.Equal(t, []byte("done"), got.Response.Body)
}
