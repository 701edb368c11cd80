package budget

import (
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
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

// With no traffic at all, time refills a drained bucket to its capacity in
// RefillTime (60 s by default), at Capacity/RefillTime tokens a second.
func TestTokenBucketRefillsWithTime(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{})
	for range 35 {
		_, ok := b.AcquireRetry(t0, false)
		require.True(t, ok)
	}
	_, ok := b.AcquireRetry(t0, false)
	require.False(t, ok, "drained: 10 tokens left")
	require.Equal(t, 10, b.Available(t0))
	// 500 tokens a minute: 8 whole tokens in the first second.
	require.Equal(t, 18, b.Available(t0.Add(time.Second)))
	_, ok = b.AcquireRetry(t0.Add(time.Second), false)
	require.True(t, ok, "a transient retry is affordable again within 14/500 of a minute")
	require.Equal(t, 4, b.Available(t0.Add(time.Second)))
	require.Equal(t, 4+250-8, b.Available(t0.Add(30*time.Second)))
	require.Equal(t, 496, b.Available(t0.Add(time.Minute)))
	require.Equal(t, 500, b.Available(t0.Add(time.Second+time.Minute)), "full again within RefillTime")
	require.Equal(t, 500, b.Available(t0.Add(time.Hour)), "never above capacity")
}

// A drained bucket with the AWS SDKs' behaviour (RefillTime negative) stays
// drained however long nothing happens: only successes refill it.
func TestTokenBucketWithoutRefillStaysDrained(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{RefillTime: -1})
	for range 35 {
		b.AcquireRetry(t0, false)
	}
	require.Equal(t, 10, b.Available(t0))
	require.Equal(t, 10, b.Available(t0.Add(24*time.Hour)))
	_, ok := b.AcquireRetry(t0.Add(24*time.Hour), false)
	require.False(t, ok)
	b.OnSuccess(t0.Add(24*time.Hour), 0)
	require.Equal(t, 11, b.Available(t0.Add(24*time.Hour)), "successes still refill it")
	require.NoError(t, TokenBucketConfig{RefillTime: -1}.Validate(), "a negative RefillTime has a meaning of its own")
}

// Time refills in whole tokens without losing the fractions: many small
// steps earn exactly what one long one does.
func TestTokenBucketRefillKeepsFractions(t *testing.T) {
	for _, step := range []time.Duration{time.Millisecond, 7 * time.Millisecond, 333 * time.Microsecond, time.Second} {
		b := NewTokenBucket(TokenBucketConfig{Capacity: 600, TransientCost: 600}) // 10 tokens a second
		_, ok := b.AcquireRetry(t0, false)
		require.True(t, ok)
		require.Zero(t, b.Available(t0))
		var at time.Duration
		for at = step; at <= 30*time.Second; at += step {
			n := b.Available(t0.Add(at))
			require.Equal(t, int(at/(100*time.Millisecond)), n, "step %v, at %v", step, at)
		}
	}
}

// Time earns nothing while the bucket is full: an hour of health does not
// bank tokens beyond Capacity, and the refill counts from the drain.
func TestTokenBucketFullEarnsNothing(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{Capacity: 60, TransientCost: 60}) // 1 token a second
	require.Equal(t, 60, b.Available(t0))
	later := t0.Add(time.Hour)
	_, ok := b.AcquireRetry(later, false)
	require.True(t, ok)
	require.Zero(t, b.Available(later))
	require.Equal(t, 5, b.Available(later.Add(5*time.Second)))
}

// A time before the latest one seen adds nothing and takes nothing.
func TestTokenBucketTimeGoingBackwards(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{Capacity: 60, TransientCost: 60})
	b.AcquireRetry(t0, false)
	require.Equal(t, 10, b.Available(t0.Add(10*time.Second)))
	require.Equal(t, 10, b.Available(t0.Add(5*time.Second)), "earlier: nothing more")
	require.Equal(t, 10, b.Available(time.Time{}))
	require.Equal(t, 11, b.Available(t0.Add(11*time.Second)), "and the refill goes on from the latest")
}

// Any Capacity, cost, reward, refund or RefillTime keeps the level in
// [0, Capacity]: the arithmetic saturates instead of overflowing.
func TestTokenBucketHugeValuesSaturate(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{Capacity: math.MaxInt, SuccessReward: math.MaxInt})
	_, ok := b.AcquireRetry(t0, false)
	require.True(t, ok)
	b.OnSuccess(t0, 0)
	require.Equal(t, math.MaxInt, b.Available(t0), "a huge reward fills the bucket, no more")
	b.AcquireRetry(t0, false)
	b.OnSuccess(t0, math.MaxInt)
	require.Equal(t, math.MaxInt, b.Available(t0), "a huge refund of a retried success")
	b.AcquireRetry(t0, false)
	b.Refund(t0, math.MaxInt)
	require.Equal(t, math.MaxInt, b.Available(t0), "a huge refund of an unsent retry")

	// Time: the shortest RefillTime with the largest bucket, over the
	// longest time a time.Duration holds, and the longest RefillTime.
	for _, refill := range []time.Duration{time.Nanosecond, math.MaxInt64} {
		b := NewTokenBucket(TokenBucketConfig{Capacity: math.MaxInt, TransientCost: math.MaxInt, RefillTime: refill})
		_, ok := b.AcquireRetry(t0, false)
		require.True(t, ok)
		require.Zero(t, b.Available(t0))
		for _, at := range []time.Time{t0.Add(time.Nanosecond), t0.Add(time.Hour), t0.AddDate(300, 0, 0)} {
			n := b.Available(at)
			require.GreaterOrEqual(t, n, 0, "refill %v at %v", refill, at)
		}
		require.Equal(t, math.MaxInt, b.Available(t0.AddDate(600, 0, 0)), "refill %v", refill)
	}
	slow := NewTokenBucket(TokenBucketConfig{Capacity: math.MaxInt, TransientCost: math.MaxInt,
		RefillTime: math.MaxInt64})
	slow.AcquireRetry(t0, false)
	require.Equal(t, 1, slow.Available(t0.Add(time.Nanosecond)), "MaxInt tokens in MaxInt64 ns: 1 a ns")
}

// Goroutines racing with a clock that moves forward: the level never
// leaves [0, capacity], and once the racing stops time fills the bucket.
func TestTokenBucketConcurrentRefill(t *testing.T) {
	b := NewTokenBucket(TokenBucketConfig{Capacity: 100, RefillTime: time.Second})
	var (
		clock atomic.Int64 // nanoseconds after t0
		wg    sync.WaitGroup
	)
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range 2000 {
				now := t0.Add(time.Duration(clock.Add(int64(rng.IntN(int(time.Millisecond))))))
				switch rng.IntN(3) {
				case 0:
					if cost, ok := b.AcquireRetry(now, rng.IntN(2) == 1); ok && rng.IntN(2) == 0 {
						b.Refund(now, cost)
					}
				case 1:
					b.OnSuccess(now, rng.IntN(20))
				}
				if n := b.Available(now); n < 0 || n > 100 {
					t.Errorf("level %d out of [0, 100]", n)
					return
				}
			}
		}()
	}
	wg.Wait()
	end := t0.Add(time.Duration(clock.Load()) + time.Second)
	require.Equal(t, 100, b.Available(end))
}
