package sqlstore_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// raceClaims runs n claims for sc at once, each with its own owner token, and
// returns what each got.
func raceClaims(t *testing.T, s idempotency.Store, sc idempotency.Scope, fp string, now time.Time, n int) ([]idempotency.Record, []bool) {
	t.Helper()
	recs := make([]idempotency.Record, n)
	oks := make([]bool, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			recs[i], oks[i], errs[i] = claimed(s.Claim(t.Context(), claimAt(sc, fmt.Sprintf("owner-%d", i), fp, now)))
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "claim %d", i)
	}
	return recs, oks
}

// requireOneWinner asserts exactly one claim acquired and every loser saw
// the winner's record.
func requireOneWinner(t *testing.T, recs []idempotency.Record, oks []bool, gen int64) idempotency.Record {
	t.Helper()
	winner := -1
	for i, ok := range oks {
		if ok {
			require.Equal(t, -1, winner, "two claims acquired: %d and %d", winner, i)
			winner = i
		}
	}
	require.NotEqual(t, -1, winner, "no claim acquired")
	w := recs[winner]
	require.Equal(t, fmt.Sprintf("owner-%d", winner), w.Owner)
	require.Equal(t, gen, w.Generation)
	for i, r := range recs {
		require.Equal(t, w.Owner, r.Owner, "claim %d saw another owner", i)
		require.Equal(t, w.Generation, r.Generation)
	}
	return w
}

func TestClaimRaceHasOneWinner(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		const n = 48
		sc := scope("race")

		// Absent record.
		recs, oks := raceClaims(t, s, sc, "fp", t0, n)
		requireOneWinner(t, recs, oks, 1)

		// Expired lease: one takeover.
		later := t0.Add(time.Minute)
		recs, oks = raceClaims(t, s, sc, "fp", later, n)
		w := requireOneWinner(t, recs, oks, 2)

		// Completed record past the replay window: one fresh start.
		require.NoError(t, s.Complete(t.Context(), w.Lease(), idempotency.Response{Status: 201}, later))
		recs, oks = raceClaims(t, s, sc, "fp", later.Add(2*time.Hour), n)
		w = requireOneWinner(t, recs, oks, 3)
		require.Nil(t, w.Response)

		// Many distinct keys at once: every one acquires.
		var wg sync.WaitGroup
		errs := make([]error, n)
		acquired := make([]bool, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, acquired[i], errs[i] = claimed(s.Claim(t.Context(), claimAt(scope(fmt.Sprintf("k-%d", i)), "o", "fp", t0)))
			}()
		}
		wg.Wait()
		for i := range n {
			require.NoError(t, errs[i])
			require.True(t, acquired[i])
		}
	})
}
