package budget

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func TestTokenBucketSteps(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{})
	type step struct {
		name     string
		do       func() (int, bool)
		wantCost int
		wantOK   bool
		want     int // Available after the step
	}
	acquire := func(throttled bool) func() (int, bool) {
		return func() (int, bool) { return b.AcquireRetry(t0, throttled) }
	}
	success := func(cost int) func() (int, bool) {
		return func() (int, bool) { b.OnSuccess(t0, cost); return 0, true }
	}
	steps := []step{
		{"starts full", func() (int, bool) { return 0, true }, 0, true, 500},
		{"first-try success at capacity stays 500", success(0), 0, true, 500},
		{"transient retry", acquire(false), 14, true, 486},
		{"second transient retry", acquire(false), 14, true, 472},
		{"throttling retry", acquire(true), 5, true, 467},
		{"refund of a successful transient retry", success(14), 0, true, 481},
		{"refund of a successful throttling retry", success(5), 0, true, 486},
		{"first-try success +1", success(0), 0, true, 487},
		{"first-try success +1 again", success(0), 0, true, 488},
		{"negative retry cost counts as a first try", success(-3), 0, true, 489},
		{"refund capped at capacity", success(14), 0, true, 500},
		{"first-try success capped at capacity", success(0), 0, true, 500},
		{"transient retry after the refills", acquire(false), 14, true, 486},
	}
	for _, s := range steps {
		cost, ok := s.do()
		require.Equal(t, s.wantCost, cost, s.name)
		require.Equal(t, s.wantOK, ok, s.name)
		require.Equal(t, s.want, b.Available(t0), s.name)
	}

	// Drain: 486 = 34*14 + 10.
	for i := range 34 {
		cost, ok := b.AcquireRetry(t0, false)
		require.True(t, ok, "retry %d", i)
		require.Equal(t, 14, cost)
	}
	require.Equal(t, 10, b.Available(t0))
	cost, ok := b.AcquireRetry(t0, false)
	require.False(t, ok, "14 > 10 left: denied")
	require.Zero(t, cost)
	require.Equal(t, 10, b.Available(t0), "a denial takes nothing")
	for _, want := range []int{5, 0} {
		cost, ok = b.AcquireRetry(t0, true)
		require.True(t, ok)
		require.Equal(t, 5, cost)
		require.Equal(t, want, b.Available(t0))
	}
	_, ok = b.AcquireRetry(t0, true)
	require.False(t, ok, "empty bucket denies throttling retries too")
	require.Equal(t, 0, b.Available(t0))
	b.OnSuccess(t0, 0)
	require.Equal(t, 1, b.Available(t0), "successes refill a drained bucket")
}

func TestTokenBucketOutageDrainsAfter35Retries(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{})
	granted := 0
	for range 1000 {
		b.OnRequest(t0)
		if _, ok := b.AcquireRetry(t0, false); ok {
			granted++
		}
	}
	require.Equal(t, 35, granted, "500/14 transient retries, then none until something succeeds")
}

func TestTokenBucketConfig(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{Capacity: 20, TransientCost: 7, ThrottleCost: 3, SuccessReward: 2})
	require.Equal(t, 20, b.Available(t0), "it starts full")
	cost, ok := b.AcquireRetry(t0, true)
	require.True(t, ok)
	require.Equal(t, 3, cost)
	b.OnSuccess(t0, cost)
	cost, ok = b.AcquireRetry(t0, false)
	require.True(t, ok)
	require.Equal(t, 7, cost)
	b.OnSuccess(t0, 0)
	require.Equal(t, 15, b.Available(t0), "reward 2")

	noReward := NewTokenBucket(TokenBucketConfig{SuccessReward: -1})
	noReward.AcquireRetry(t0, true)
	noReward.OnSuccess(t0, 0)
	require.Equal(t, 495, noReward.Available(t0), "negative reward disables it")
	noReward.OnSuccess(t0, 5)
	require.Equal(t, 500, noReward.Available(t0), "refunds still work")

	// A negative field is never the default in disguise: it grants fewer
	// retries (none of its kind).
	empty := NewTokenBucket(TokenBucketConfig{Capacity: -1})
	require.Zero(t, empty.Available(t0), "a bucket of no tokens")
	_, ok = empty.AcquireRetry(t0, true)
	require.False(t, ok)
	empty.OnSuccess(t0, 0)
	require.Zero(t, empty.Available(t0), "never above its capacity")
	neverTransient := NewTokenBucket(TokenBucketConfig{TransientCost: -2})
	_, ok = neverTransient.AcquireRetry(t0, false)
	require.False(t, ok, "a negative cost: never granted")
	cost, ok = neverTransient.AcquireRetry(t0, true)
	require.True(t, ok)
	require.Equal(t, 5, cost)
	require.Equal(t, 495, neverTransient.Available(t0))
	neverThrottled := NewTokenBucket(TokenBucketConfig{ThrottleCost: -3})
	_, ok = neverThrottled.AcquireRetry(t0, true)
	require.False(t, ok)
	require.Equal(t, 500, neverThrottled.Available(t0), "a denial takes nothing")
}

func TestTokenBucketConfigValidate(t *testing.T) {
	require.NoError(t, TokenBucketConfig{}.Validate())
	require.NoError(t, TokenBucketConfig{SuccessReward: -1}.Validate())
	for _, c := range []struct {
		cfg   TokenBucketConfig
		field string
	}{
		{TokenBucketConfig{Capacity: -1}, "TokenBucketConfig.Capacity"},
		{TokenBucketConfig{TransientCost: -1}, "TokenBucketConfig.TransientCost"},
		{TokenBucketConfig{ThrottleCost: -1}, "TokenBucketConfig.ThrottleCost"},
	} {
		err := c.cfg.Validate()
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.Contains(t, err.Error(), c.field+"=-1: must not be negative")
	}
}

func TestUnlimited(t *testing.T) {
	u := Unlimited()
	for range 10_000 {
		u.OnRequest(t0)
		cost, ok := u.AcquireRetry(t0, false)
		require.True(t, ok)
		require.Zero(t, cost)
	}
	u.OnSuccess(t0, 0)
	require.Greater(t, u.Available(t0), 1<<30)
}

// TestTokenBucketConcurrentConservation runs many goroutines that acquire and
// refund at random: no token is created or lost, the level never leaves
// [0, capacity], and refunding everything outstanding restores a full bucket.
func TestTokenBucketConcurrentConservation(t *testing.T) {
	const workers, ops = 64, 2000
	b := NewTokenBucket(TokenBucketConfig{SuccessReward: -1}) // refunds only: exact accounting
	var (
		wg                 sync.WaitGroup
		mu                 sync.Mutex
		acquired, refunded int
		outstanding        [][]int
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			var held []int
			acq, ref := 0, 0
			for range ops {
				if len(held) > 0 && rng.IntN(2) == 0 {
					c := held[len(held)-1]
					held = held[:len(held)-1]
					b.OnSuccess(t0, c)
					ref += c
				} else if cost, ok := b.AcquireRetry(t0, rng.IntN(2) == 1); ok {
					held = append(held, cost)
					acq += cost
				}
				if n := b.Available(t0); n < 0 || n > 500 {
					t.Errorf("level %d out of [0, 500]", n)
					return
				}
			}
			mu.Lock()
			acquired += acq
			refunded += ref
			outstanding = append(outstanding, held)
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Positive(t, acquired)
	require.Equal(t, 500-acquired+refunded, b.Available(t0), "tokens conserved")
	for _, held := range outstanding {
		for _, c := range held {
			b.OnSuccess(t0, c)
		}
	}
	require.Equal(t, 500, b.Available(t0), "every token taken came back")
}

// TestTokenBucketConcurrentNoOverdraw: with the bucket never refilled, exactly
// capacity/cost retries are granted however many goroutines race for them.
func TestTokenBucketConcurrentNoOverdraw(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	granted := 0
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				if _, ok := b.AcquireRetry(t0, true); ok {
					mu.Lock()
					granted++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 100, granted, "500/5")
	require.Equal(t, 0, b.Available(t0))
}

func TestTokenBucketRefundGivesBackAnUnsentRetry(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{})
	cost, ok := b.AcquireRetry(t0, false)
	require.True(t, ok)
	require.Equal(t, 486, b.Available(t0))
	b.Refund(t0, cost)
	require.Equal(t, 500, b.Available(t0), "the unsent retry's tokens are back")
	b.Refund(t0, 14)
	require.Equal(t, 500, b.Available(t0), "never above capacity")
	b.Refund(t0, 0)
	b.Refund(t0, -5)
	require.Equal(t, 500, b.Available(t0), "a cost of 0 or less gives nothing and takes nothing")
}
