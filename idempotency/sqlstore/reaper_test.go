package sqlstore_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// TestReaperDeletesOnlyPastTheHorizonInBatches, on both dialects: the
// generic Reaper over the SQL store deletes exactly the records past the
// cleanup horizon and reports the unfinished one.
func TestReaperDeletesOnlyPastTheHorizonInBatches(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		now := t0.Add(200 * time.Hour)
		old := now.Add(-100 * time.Hour)
		horizon := now.Add(-72 * time.Hour) // the default cleanup horizon

		var oldKeys, keptKeys []string
		for i := range 7 {
			k := fmt.Sprintf("old-%d", i)
			rec, _, err := claimed(s.Claim(ctx, claimAt(scope(k), "o", "fp", old.Add(time.Duration(i)*time.Second))))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201}, old.Add(time.Duration(i)*time.Second)))
			oldKeys = append(oldKeys, k)
		}
		// Abandoned long ago with a recovery point: deleted, and reported.
		stuck, _, err := claimed(s.Claim(ctx, claimAt(scope("stuck"), "o", "fp", old)))
		require.NoError(t, err)
		require.NoError(t, s.SetRecoveryPoint(ctx, stuck.Lease(), "charged", []byte("ch_9"), old))
		oldKeys = append(oldKeys, "stuck")
		// Completed exactly at the horizon, completed recently, running now,
		// and old but heartbeated past the horizon: all kept.
		edge, _, err := claimed(s.Claim(ctx, claimAt(scope("edge"), "o", "fp", horizon)))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, edge.Lease(), idempotency.Response{Status: 200}, horizon))
		recent, _, err := claimed(s.Claim(ctx, claimAt(scope("recent"), "o", "fp", now.Add(-time.Hour))))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, recent.Lease(), idempotency.Response{Status: 200}, now.Add(-time.Hour)))
		_, _, err = claimed(s.Claim(ctx, claimAt(scope("running"), "o", "fp", now)))
		require.NoError(t, err)
		longRunning, _, err := claimed(s.Claim(ctx, claimAt(scope("long-running"), "o", "fp", old)))
		require.NoError(t, err)
		require.NoError(t, s.Heartbeat(ctx, longRunning.Lease(), now.Add(time.Minute)))
		keptKeys = append(keptKeys, "edge", "recent", "running", "long-running")

		r := idempotency.New(s, idempotency.WithLogger(nil)).Reaper()
		rep, err := r.ReapOnce(ctx, now)
		require.NoError(t, err)
		require.Equal(t, 8, rep.Deleted)
		require.Equal(t, 1, rep.Batches)
		require.False(t, rep.More)
		require.Len(t, rep.Unfinished, 1)
		require.Equal(t, "stuck", rep.Unfinished[0].Scope.Key)
		require.Equal(t, "charged", rep.Unfinished[0].RecoveryPoint)
		require.Zero(t, rep.Skipped)

		for _, k := range oldKeys {
			_, err := s.Get(ctx, scope(k))
			require.ErrorIs(t, err, idempotency.ErrNotFound, k)
		}
		for _, k := range keptKeys {
			_, err := s.Get(ctx, scope(k))
			require.NoError(t, err, k)
		}
	})
}
