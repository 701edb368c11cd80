package sqlstore_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// takeoverOnly is the completer's claim of sc by owner at now.
func takeoverOnly(sc idempotency.Scope, owner, fp string, now time.Time) idempotency.Claim {
	c := claimAt(sc, owner, fp, now)
	c.Request, c.TakeoverOnly = nil, true
	return c
}

// TestTakeoverOnlyClaimNeverCreatesOrRestarts checks Claim.TakeoverOnly on
// both dialects: an absent scope gets a zero record and stays absent; a
// completed record, even far past the replay window, is returned as it is; a
// live lease, another fingerprint or another fingerprint version is not
// taken over; an expired lease with the same fingerprint is, keeping the
// request, recovery point and creation time.
func TestTakeoverOnlyClaimNeverCreatesOrRestarts(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)

		rec, ok, err := claimed(s.Claim(ctx, takeoverOnly(scope("absent"), "C", "fp", t0)))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, idempotency.Record{}, rec)
		_, err = s.Get(ctx, scope("absent"))
		require.ErrorIs(t, err, idempotency.ErrNotFound, "a takeover-only claim created a record")

		done, _, err := claimed(s.Claim(ctx, claimAt(scope("done"), "A", "fp", t0)))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, done.Lease(), idempotency.Response{Status: 201, Body: []byte("d")}, t0))
		c := takeoverOnly(scope("done"), "C", "fp", t0.Add(100*time.Hour)) // ReplayWindow 1 h is set: TakeoverOnly wins
		rec, ok, err = claimed(s.Claim(ctx, c))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, idempotency.Completed, rec.State)
		require.Equal(t, "A", rec.Owner)
		require.Equal(t, int64(1), rec.Generation)
		require.Equal(t, "d", string(rec.Response.Body))

		orig := claimAt(scope("running"), "A", "fp", t0)
		first, ok, err := claimed(s.Claim(ctx, orig))
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, s.SetRecoveryPoint(ctx, first.Lease(), "charged", []byte("ch_1"), t0.Add(time.Second)))
		// Alive up to and including its end.
		rec, ok, err = claimed(s.Claim(ctx, takeoverOnly(orig.Scope, "C", "fp", first.LeaseUntil)))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, first.Lease(), rec.Lease())
		// Expired, but another request.
		later := first.LeaseUntil.Add(time.Nanosecond)
		rec, ok, err = claimed(s.Claim(ctx, takeoverOnly(orig.Scope, "C", "other-fp", later)))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, first.Lease(), rec.Lease())
		v2 := takeoverOnly(orig.Scope, "C", "fp", later)
		v2.FingerprintVersion = 2
		rec, ok, err = claimed(s.Claim(ctx, v2))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, first.Lease(), rec.Lease())

		rec, ok, err = claimed(s.Claim(ctx, takeoverOnly(orig.Scope, "C", "fp", later)))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "C", rec.Owner)
		require.Equal(t, int64(2), rec.Generation)
		require.Equal(t, idempotency.InProgress, rec.State)
		require.True(t, rec.LeaseUntil.Equal(later.Add(10*time.Second)))
		require.True(t, rec.UpdatedAt.Equal(later))
		require.True(t, rec.CreatedAt.Equal(t0))
		require.Equal(t, orig.Request, rec.Request, "the stored request is kept")
		require.Equal(t, "charged", rec.RecoveryPoint)
		require.Equal(t, "ch_1", string(rec.RecoveryData))
		require.Nil(t, rec.Response)
		got, err := s.Get(ctx, orig.Scope)
		require.NoError(t, err)
		require.Equal(t, rec, got)

		// The fence moved: the old owner's writes are refused, the new
		// owner's go through.
		require.ErrorIs(t, s.Heartbeat(ctx, first.Lease(), later.Add(time.Minute)), idempotency.ErrLeaseLost)
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 200}, later))
	})
}

// TestTakeoverOnlyClaimRaceHasOneWinner runs many takeover-only claims of
// one expired record at once, beside a plain claim of an absent scope that
// is released meanwhile: exactly one takeover wins (generation 2), every
// loser sees the winner, and nothing is created for the released scope.
func TestTakeoverOnlyClaimRaceHasOneWinner(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		first, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)
		gone, _, err := claimed(s.Claim(ctx, claimAt(scope("gone"), "A", "fp", t0)))
		require.NoError(t, err)
		later := t0.Add(time.Minute)

		const n = 24
		recs := make([]idempotency.Record, n)
		oks := make([]bool, n)
		errs := make([]error, n)
		goneOK := make([]bool, n)
		goneErrs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				recs[i], oks[i], errs[i] = claimed(s.Claim(ctx, takeoverOnly(scope("k"), fmt.Sprintf("owner-%d", i), "fp", later)))
				_, goneOK[i], goneErrs[i] = claimed(s.Claim(ctx, takeoverOnly(scope("gone"), fmt.Sprintf("owner-%d", i), "fp", t0)))
			}()
		}
		close(start)
		require.NoError(t, s.Release(ctx, gone.Lease()))
		wg.Wait()
		for i := range n {
			require.NoError(t, errs[i])
			require.NoError(t, goneErrs[i])
			require.False(t, goneOK[i], "the live lease of gone, or gone itself, is never taken")
		}
		w := requireOneWinner(t, recs, oks, first.Generation+1)
		require.Equal(t, first.Request, w.Request)
		_, err = s.Get(ctx, scope("gone"))
		require.ErrorIs(t, err, idempotency.ErrNotFound, "a takeover-only claim recreated a released record")
	})
}

// TestClaimOutcomeIsTheRecordsPreviousState: the outcome of a claim that
// wins a record is what the record was, whatever its times say. A lease
// that ended before the record was created (a heartbeat into
// the past, a clock stepped back) lets a claim at exactly CreatedAt take
// the record over: ClaimTakenOver with the recovery point, its data and
// the request it kept, on every dialect. A completed record restarted by a
// claim at its own CreatedAt is ClaimCreated, as a fresh record.
func TestClaimOutcomeIsTheRecordsPreviousState(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)

		a, _, err := claimed(s.Claim(ctx, claimAt(scope("taken"), "A", "fp", t0)))
		require.NoError(t, err)
		require.NoError(t, s.SetRecoveryPoint(ctx, a.Lease(), "charged", []byte("ch_1"),
			t0.Add(time.Millisecond)))
		require.NoError(t, s.Heartbeat(ctx, a.Lease(), t0.Add(-50*time.Millisecond)))
		res, err := s.Claim(ctx, claimAt(scope("taken"), "B", "fp", t0))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimTakenOver, res.Outcome)
		require.Equal(t, "B", res.Record.Owner)
		require.Equal(t, a.Generation+1, res.Record.Generation)
		require.Equal(t, "charged", res.Record.RecoveryPoint)
		require.Equal(t, "ch_1", string(res.Record.RecoveryData))
		require.Equal(t, "req-A", string(res.Record.Request))
		require.True(t, res.Record.CreatedAt.Equal(t0))
		got, err := s.Get(ctx, scope("taken"))
		require.NoError(t, err)
		require.Equal(t, res.Record, got)

		d, _, err := claimed(s.Claim(ctx, claimAt(scope("restarted"), "A", "fp", t0)))
		require.NoError(t, err)
		require.NoError(t, s.SetRecoveryPoint(ctx, d.Lease(), "charged", nil, t0))
		require.NoError(t, s.Complete(ctx, d.Lease(), idempotency.Response{Status: 201},
			t0.Add(-2*time.Hour))) // past the 1 h window of a claim at t0
		res, err = s.Claim(ctx, claimAt(scope("restarted"), "B", "fp", t0))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, res.Outcome)
		require.Equal(t, d.Generation+1, res.Record.Generation)
		require.Empty(t, res.Record.RecoveryPoint)
		require.Equal(t, "req-B", string(res.Record.Request))
		got, err = s.Get(ctx, scope("restarted"))
		require.NoError(t, err)
		require.Equal(t, res.Record, got)
	})
}
