package budget

import (
	"strconv"
	"sync/atomic"
	"time"
)

// Defaults of a [TokenBucket], the numbers of the AWS SDKs' retry behaviour 2.1.
const (
	defaultCapacity      = 500 // tokens in a full bucket; a bucket starts full
	defaultTransientCost = 14  // tokens a retry after a transient failure costs
	defaultThrottleCost  = 5   // tokens a retry after throttling costs
	defaultSuccessReward = 1   // tokens a first-try success adds (never above capacity)
)

// TokenBucketConfig configures [NewTokenBucket]. The zero value means all
// defaults: each zero field means its default. A negative field is never
// a default in disguise: each says what it means.
type TokenBucketConfig struct {
	// Capacity is the size of the bucket, which starts full. 0 means 500;
	// a negative value (refused by Validate) means a bucket of no tokens,
	// which grants no retry.
	Capacity int
	// TransientCost is what a retry after a transient failure takes. 0
	// means 14; a negative value (refused by Validate) means that such a
	// retry is never granted.
	TransientCost int
	// ThrottleCost is what a retry after throttling takes. 0 means 5; a
	// negative value (refused by Validate) means that such a retry is
	// never granted.
	ThrottleCost int
	// SuccessReward is what a first-try success adds, never above Capacity.
	// 0 means 1; a negative value disables the reward, leaving only refunds
	// to refill the bucket.
	SuccessReward int
}

// Validate reports the first negative Capacity, TransientCost or
// ThrottleCost, as an error matching [ErrInvalidConfig]: NewTokenBucket
// would make such a bucket deny those retries. It returns nil for the zero
// value and for a negative SuccessReward, which has a meaning of its own.
func (c TokenBucketConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{{"Capacity", c.Capacity}, {"TransientCost", c.TransientCost}, {"ThrottleCost", c.ThrottleCost}} {
		if f.v < 0 {
			return configError("TokenBucketConfig."+f.name, strconv.Itoa(f.v), "must not be negative")
		}
	}
	return nil
}

// TokenBucket is the default [Budget], the retry quota of the AWS SDKs'
// retry behaviour 2.1: a bucket of Capacity tokens, starting full. A retry takes
// its cost (TransientCost or ThrottleCost) and is denied, taking nothing, when
// the cost exceeds what is left. A retry that succeeds refunds its cost; a
// first-try success adds SuccessReward; the bucket never exceeds Capacity.
// There is no refill with time: only successes refill it, so during a full
// outage the bucket drains after Capacity/TransientCost retries (35 with the
// defaults) and further failures are not retried until requests succeed again.
//
// A TokenBucket is safe for concurrent use (the level is an atomic integer,
// updated by compare-and-swap) and starts no goroutines. It ignores time and
// OnRequest. Create it with [NewTokenBucket]; the zero value is not usable.
type TokenBucket struct {
	capacity, transient, throttle, reward int

	tokens atomic.Int64 // between 0 and capacity; updated by compare-and-swap
}

var _ Budget = (*TokenBucket)(nil)

// NewTokenBucket returns a full bucket configured by c, zero fields meaning
// the defaults (500 tokens, transient retry 14, throttling retry 5, first-try
// success +1). It never fails: a negative field means what
// [TokenBucketConfig] says (use its Validate method to reject it instead).
func NewTokenBucket(c TokenBucketConfig) *TokenBucket {
	b := &TokenBucket{
		capacity:  orDefault(c.Capacity, defaultCapacity, 0),
		transient: orDefault(c.TransientCost, defaultTransientCost, -1),
		throttle:  orDefault(c.ThrottleCost, defaultThrottleCost, -1),
		reward:    orDefault(c.SuccessReward, defaultSuccessReward, 0),
	}
	b.tokens.Store(int64(b.capacity))
	return b
}

// orDefault returns v when it is positive, def when it is 0, and neg when
// it is negative.
func orDefault(v, def, neg int) int {
	switch {
	case v == 0:
		return def
	case v < 0:
		return neg
	}
	return v
}

// cost returns what a retry costs in this bucket: ThrottleCost when
// throttled, else TransientCost; -1 for a retry never granted.
func (b *TokenBucket) cost(throttled bool) int {
	if throttled {
		return b.throttle
	}
	return b.transient
}

// OnRequest does nothing: a token bucket counts successes, not requests.
func (b *TokenBucket) OnRequest(time.Time) {}

// AcquireRetry takes the retry's cost (ThrottleCost or TransientCost) in
// tokens and returns it and true, or returns (0, false) and takes nothing
// when fewer are left (or the cost is negative: such retries are never
// granted).
// Safe for concurrent use; now is ignored.
func (b *TokenBucket) AcquireRetry(_ time.Time, throttled bool) (int, bool) {
	cost := int64(b.cost(throttled))
	for {
		tokens := b.tokens.Load()
		if cost < 0 || cost > tokens {
			return 0, false
		}
		if b.tokens.CompareAndSwap(tokens, tokens-cost) {
			return int(cost), true
		}
	}
}

// Refund puts cost back when it is positive, never above Capacity. Safe for
// concurrent use; now is ignored.
func (b *TokenBucket) Refund(_ time.Time, cost int) {
	if cost > 0 {
		b.add(int64(cost))
	}
}

// OnSuccess refunds retryCost when it is positive (a retry succeeded), or
// adds the success reward when retryCost is 0 or negative (attempt 1
// succeeded); either way never above Capacity. Safe for concurrent use; now
// is ignored.
func (b *TokenBucket) OnSuccess(_ time.Time, retryCost int) {
	add := int64(b.reward)
	if retryCost > 0 {
		add = int64(retryCost)
	}
	b.add(add)
}

// add puts n tokens in the bucket, never above capacity.
func (b *TokenBucket) add(n int64) {
	if n <= 0 {
		return
	}
	capacity := int64(b.capacity)
	for {
		tokens := b.tokens.Load()
		if tokens >= capacity {
			return // full: the common case of a healthy host costs one load
		}
		if b.tokens.CompareAndSwap(tokens, tokens+min(capacity-tokens, n)) {
			return
		}
	}
}

// Available returns the tokens left, between 0 and Capacity. Safe for
// concurrent use; now is ignored.
func (b *TokenBucket) Available(time.Time) int { return int(b.tokens.Load()) }
