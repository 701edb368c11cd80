package budget

import (
	"math/bits"
	"strconv"
	"sync"
	"time"
)

// Defaults of a [TokenBucket]: the numbers of the AWS SDKs' retry behaviour
// 2.1, and a refill with time of the whole capacity in a minute.
const (
	defaultCapacity      = 500              // tokens in a full bucket, which it starts as
	defaultTransientCost = 14               // tokens a retry after a transient failure costs
	defaultThrottleCost  = 5                // tokens a retry after throttling costs
	defaultSuccessReward = 1                // tokens a first-try success adds
	defaultRefillTime    = 60 * time.Second // time alone refills an empty bucket in this long
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
	// (and RefillTime) to refill the bucket.
	SuccessReward int
	// RefillTime is how long time alone takes to refill an empty bucket to
	// Capacity with no traffic at all, at a steady Capacity/RefillTime
	// tokens per second (in whole tokens). 0 means 60 s; a negative value
	// means no refill with time: only successes refill the bucket, as in
	// the AWS SDKs.
	RefillTime time.Duration
}

// Validate reports the first negative Capacity, TransientCost or
// ThrottleCost, as an error matching [ErrInvalidConfig]: NewTokenBucket
// would make such a bucket deny those retries. It returns nil for the zero
// value and for a negative SuccessReward or RefillTime, which have meanings
// of their own.
func (c TokenBucketConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{
		{"Capacity", c.Capacity},
		{"TransientCost", c.TransientCost},
		{"ThrottleCost", c.ThrottleCost},
	} {
		if f.v < 0 {
			return configError("TokenBucketConfig."+f.name, strconv.Itoa(f.v),
				"must not be negative")
		}
	}
	return nil
}

// TokenBucket is the default [Budget]: the retry quota of the AWS SDKs'
// retry behaviour 2.1, which also refills with time. A bucket of Capacity
// tokens, starting full. A retry takes its cost (TransientCost or
// ThrottleCost) and is denied, taking nothing, when the cost exceeds what
// is left. A retry that succeeds refunds its cost; a first-try success adds
// SuccessReward; and time adds Capacity tokens per RefillTime; the bucket
// never exceeds Capacity.
//
// During a full outage the bucket drains after Capacity/TransientCost
// retries (35 with the defaults); then time alone pays for further retries,
// Capacity/(RefillTime*TransientCost) a second (one transient retry every
// 1.68 s with the defaults, whatever the traffic), and with no traffic at
// all a drained bucket is full again after RefillTime (60 s). A client
// that sends few requests thus retries again soon after an incident, while
// a fleet in a full outage adds that small rate per process to the load.
// With RefillTime negative only successes refill the bucket (the AWS SDKs'
// behaviour): a drained bucket then stays drained until requests succeed
// again, roughly Capacity first-try successes.
//
// Time is what the methods are given (now), never read from a clock: a time
// before the latest one seen adds nothing. All arithmetic saturates: any
// Capacity, cost, reward or refund keeps the level in [0, Capacity].
//
// A TokenBucket is safe for concurrent use (a mutex guards the level) and
// starts no goroutines. It ignores OnRequest. Create it with
// [NewTokenBucket]; the zero value is not usable.
type TokenBucket struct {
	capacity, transient, throttle, reward int
	refill                                time.Duration // > 0; 0 for no refill with time

	mu     sync.Mutex
	tokens int       // between 0 and capacity
	seen   bool      // whether last holds a time
	last   time.Time // time's refill is counted up to here
}

var _ Budget = (*TokenBucket)(nil)

// NewTokenBucket returns a full bucket configured by c, zero fields meaning
// the defaults (500 tokens, transient retry 14, throttling retry 5, first-try
// success +1, refilled with time in 60 s). It never fails: a negative field
// means what [TokenBucketConfig] says (use its Validate method to reject it
// instead).
func NewTokenBucket(c TokenBucketConfig) *TokenBucket {
	b := &TokenBucket{
		capacity:  orDefault(c.Capacity, defaultCapacity, 0),
		transient: orDefault(c.TransientCost, defaultTransientCost, -1),
		throttle:  orDefault(c.ThrottleCost, defaultThrottleCost, -1),
		reward:    orDefault(c.SuccessReward, defaultSuccessReward, 0),
		refill:    max(0, c.RefillTime),
	}
	if c.RefillTime == 0 {
		b.refill = defaultRefillTime
	}
	b.tokens = b.capacity
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

// refillLocked adds the whole tokens that time has earned since b.last,
// never above capacity, and moves b.last by the time they took, so that no
// fraction of a token is lost. While the bucket is full, time earns
// nothing. b.mu must be held.
func (b *TokenBucket) refillLocked(now time.Time) {
	if b.refill <= 0 || b.capacity <= 0 {
		return
	}
	if !b.seen {
		b.seen, b.last = true, now
		return
	}
	if !now.After(b.last) {
		return // the same instant, or a time before the latest seen
	}
	room := b.capacity - b.tokens
	n := tokensIn(now.Sub(b.last), b.capacity, b.refill)
	switch {
	case n >= room:
		b.tokens, b.last = b.capacity, now
	case n > 0:
		b.tokens += n
		b.last = b.last.Add(timeFor(n, b.capacity, b.refill))
	}
}

// tokensIn returns floor(d*capacity/refill), the whole tokens that d earns,
// or capacity when that is more. d, capacity and refill are positive; the
// product is computed in 128 bits.
func tokensIn(d time.Duration, capacity int, refill time.Duration) int {
	hi, lo := bits.Mul64(uint64(d), uint64(capacity))
	if hi >= uint64(refill) {
		return capacity // the quotient does not fit in 64 bits
	}
	q, _ := bits.Div64(hi, lo, uint64(refill))
	if q >= uint64(capacity) {
		return capacity
	}
	return int(q)
}

// timeFor returns ceil(n*refill/capacity), the time that earns n tokens, for
// 0 < n < capacity: less than refill, and never more than the time that
// tokensIn turned into n.
func timeFor(n, capacity int, refill time.Duration) time.Duration {
	hi, lo := bits.Mul64(uint64(n), uint64(refill))
	q, r := bits.Div64(hi, lo, uint64(capacity)) // n < capacity: hi < capacity
	if r != 0 {
		q++
	}
	return time.Duration(q)
}

// OnRequest does nothing: a token bucket counts successes, not requests.
func (b *TokenBucket) OnRequest(time.Time) {}

// AcquireRetry takes the retry's cost (ThrottleCost or TransientCost) in
// tokens and returns it and true, or returns (0, false) and takes nothing
// when fewer are left at now (or the cost is negative: such retries are
// never granted). Safe for concurrent use.
func (b *TokenBucket) AcquireRetry(now time.Time, throttled bool) (int, bool) {
	cost := b.cost(throttled)
	if cost < 0 {
		return 0, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(now)
	if cost > b.tokens {
		return 0, false
	}
	b.tokens -= cost
	return cost, true
}

// Refund puts cost back when it is positive, never above Capacity. Safe for
// concurrent use.
func (b *TokenBucket) Refund(now time.Time, cost int) { b.add(now, cost) }

// OnSuccess refunds retryCost when it is positive (a retry succeeded), or
// adds the success reward when retryCost is 0 or negative (attempt 1
// succeeded); either way never above Capacity. Safe for concurrent use.
func (b *TokenBucket) OnSuccess(now time.Time, retryCost int) {
	if retryCost > 0 {
		b.add(now, retryCost)
		return
	}
	b.add(now, b.reward)
}

// add puts n tokens in the bucket when n is positive, never above capacity.
func (b *TokenBucket) add(now time.Time, n int) {
	if n <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(now)
	b.tokens += min(b.capacity-b.tokens, n)
}

// Available returns the tokens left at now, between 0 and Capacity. Safe
// for concurrent use.
func (b *TokenBucket) Available(now time.Time) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(now)
	return b.tokens
}
