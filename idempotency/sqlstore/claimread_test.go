package sqlstore_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// winsRecord reports whether c wins rec by the contract: in progress, its
// lease ended before c.Now, the same fingerprint and version; or, unless c
// is takeover-only, completed before the replay window.
func winsRecord(rec idempotency.Record, c idempotency.Claim) bool {
	switch rec.State {
	case idempotency.InProgress:
		return rec.LeaseUntil.Before(c.Now) && rec.Fingerprint == c.Fingerprint &&
			rec.FingerprintVersion == c.FingerprintVersion
	case idempotency.Completed:
		return !c.TakeoverOnly && c.ReplayWindow > 0 &&
			rec.CompletedAt.Before(c.Now.Add(-c.ReplayWindow))
	}
	return false
}

// TestClaimNeverAnswersARecordItWouldWin changes the record between a
// claim's first statement and whatever it sends next (the read of the
// record to answer from, on the dialects where the first statement did
// not answer), on every dialect: a claim answers either as of a moment
// when it lost, or wins; never ClaimExisting with a record that it would
// have won as the answer shows it.
func TestClaimNeverAnswersARecordItWouldWin(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		db, log := openCounted(t, b)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx))
		check := func(t *testing.T, c idempotency.Claim, res idempotency.ClaimResult) {
			t.Helper()
			if res.Outcome == idempotency.ClaimExisting && res.Record.State != idempotency.Absent {
				require.False(t, winsRecord(res.Record, c),
					"ClaimExisting with a record the claim wins: %+v", res.Record)
			}
			got, err := s.Get(ctx, c.Scope)
			if res.Acquired() {
				require.NoError(t, err)
				require.Equal(t, c.Owner, got.Owner, "the store holds the winner")
				require.Equal(t, res.Record.Generation, got.Generation)
			}
		}

		t.Run("a takeover-only claim against a record created meanwhile", func(t *testing.T) {
			sc := scope("created")
			c := takeoverOnly(sc, "B", "fp", t0.Add(time.Hour)) // every lease of t0 has ended
			log.afterNext(func() {
				_, won, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", t0)))
				require.NoError(t, err)
				require.True(t, won)
			})
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			check(t, c, res)
		})

		t.Run("a claim against a lease ended meanwhile", func(t *testing.T) {
			sc := scope("ended")
			a, _, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", t0)))
			require.NoError(t, err)
			c := claimAt(sc, "B", "fp", t0.Add(time.Second)) // A's lease is live
			log.afterNext(func() {
				require.NoError(t, s.Heartbeat(ctx, a.Lease(), t0.Add(time.Millisecond)))
			})
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			check(t, c, res)
		})

		t.Run("a claim against a release meanwhile", func(t *testing.T) {
			sc := scope("released")
			a, _, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", t0)))
			require.NoError(t, err)
			c := claimAt(sc, "B", "fp", t0.Add(time.Second)) // A's lease is live
			log.afterNext(func() { require.NoError(t, s.Release(ctx, a.Lease())) })
			m := log.mark()
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			var verbs []string
			for _, st := range log.since(m) {
				if v := verb(st); v != "DELETE" { // the release
					verbs = append(verbs, v)
				}
			}
			check(t, c, res)
			// The INSERT found A's record, the read found none: the claim
			// starts over and creates the record.
			require.Equal(t, idempotency.ClaimCreated, res.Outcome)
			require.Equal(t, []string{"INSERT", "SELECT", "INSERT"}, verbs)
		})

		t.Run("a claim against a completion past the window meanwhile", func(t *testing.T) {
			sc := scope("completed")
			a, _, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", t0)))
			require.NoError(t, err)
			c := claimAt(sc, "B", "fp", t0.Add(time.Second)) // live, and the window is 1 h
			log.afterNext(func() {
				require.NoError(t, s.Complete(ctx, a.Lease(), idempotency.Response{Status: 201},
					t0.Add(-2*time.Hour)))
			})
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			check(t, c, res)
		})
	})
}
