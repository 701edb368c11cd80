package budget

import (
	"math"
	"strconv"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Defaults of a [Ratio] budget.
const (
	defaultRatio          = 0.2              // retries per logical request in the window
	defaultWindow         = 10 * time.Second // length of the sliding window
	defaultBuckets        = 10               // sub-buckets of the window (1 s each by default)
	defaultFloorPerSecond = 10.0             // retries per second allowed whatever the traffic
)

// ppmScale converts the ratio to integer parts per million so that the
// comparison retries <= ratio*requests is exact.
const ppmScale = 1_000_000

// maxRatio bounds Ratio so that ratio*requests cannot overflow.
const maxRatio = 1000

// RatioConfig configures [NewRatio]. The zero value means all defaults:
// each zero field means its default. A value Validate refuses is never a
// default in disguise: each field says what it means, always fewer retries
// than asked.
type RatioConfig struct {
	// Ratio is the share of requests that may be retried within the window,
	// resolved to parts per million. 0 means 0.2. Refused by Validate: a
	// negative value or NaN means no ratio credit (only the floor grants
	// retries); a value above 1000, +Inf included, means 1000.
	Ratio float64
	// Window is the length of the sliding window. 0 means 10 s; a negative
	// value (refused by Validate) means no ratio credit, as a negative
	// Ratio does.
	Window time.Duration
	// Buckets is the number of fixed sub-buckets the window is made of (the
	// window moves one sub-bucket at a time), at most one per nanosecond of
	// Window. 0 means 10; a negative value (refused by Validate) means no
	// ratio credit, as a negative Ratio does.
	Buckets int
	// FloorPerSecond is the rate of retries allowed even without requests
	// to fund them, through a golang.org/x/time/rate Limiter. 0 means 10; a
	// negative value disables the floor; NaN and infinities (refused by
	// Validate) disable it too.
	FloorPerSecond float64
	// FloorBurst is the floor limiter's burst. 0 means FloorPerSecond rounded
	// up (10 by default); a negative value (refused by Validate) disables
	// the floor.
	FloorBurst int
}

// Validate reports the first field that does not mean what its type says:
// Ratio NaN, infinite, negative or above 1000; Window, Buckets or
// FloorBurst negative; FloorPerSecond NaN or infinite. NewRatio gives each
// the meaning its field documents. It returns an error matching
// [ErrInvalidConfig], or nil (also for the zero value).
func (c RatioConfig) Validate() error {
	bad := func(field, value, reason string) error {
		return configError("RatioConfig."+field, value, reason)
	}
	switch {
	case math.IsNaN(c.Ratio) || math.IsInf(c.Ratio, 0) || c.Ratio < 0 || c.Ratio > maxRatio:
		return bad("Ratio", strconv.FormatFloat(c.Ratio, 'g', -1, 64), "must be in [0, 1000]")
	case c.Window < 0:
		return bad("Window", c.Window.String(), "must not be negative")
	case c.Buckets < 0:
		return bad("Buckets", strconv.Itoa(c.Buckets), "must not be negative")
	case math.IsNaN(c.FloorPerSecond) || math.IsInf(c.FloorPerSecond, 0):
		floor := strconv.FormatFloat(c.FloorPerSecond, 'g', -1, 64)
		return bad("FloorPerSecond", floor, "must be finite")
	case c.FloorBurst < 0:
		return bad("FloorBurst", strconv.Itoa(c.FloorBurst), "must not be negative")
	}
	return nil
}

// Ratio is a proportional [Budget]: within a sliding window, retries may be at
// most Ratio times the logical requests, plus a floor of FloorPerSecond
// retries per second so that a client with little traffic can still retry.
//
// Precisely:
//   - "Requests" are logical requests, counted once each by OnRequest (the
//     client calls it before attempt 1); retries are never counted as requests.
//     "Retries" are the grants of AcquireRetry (each counts 1, throttled or not).
//   - Time is cut into fixed sub-buckets of Window/Buckets, counted from the
//     first time the budget sees. The window at time t, W(t), is the sub-bucket
//     holding t and the Buckets-1 before it: it covers at least the last
//     Window-Window/Buckets and never more than the last Window.
//   - AcquireRetry at t first tries the ratio: it grants when
//     ratioRetries(W(t))+1 <= Ratio*requests(W(t)), where ratioRetries are the
//     grants made this way. Otherwise it asks the floor
//     (rate.Limiter.AllowN(t, 1) with FloorPerSecond and FloorBurst).
//     Otherwise it denies and takes nothing.
//
// Guarantees, for every interval [a, b]:
//
//	retries in [a, b] <= Ratio * requests in (a-Window, b] + FloorBurst + FloorPerSecond*(b-a)
//
// (the windows of the last ratio grants before b, taken back to a, are
// disjoint and lie in (a-Window, b]; the floor is a token bucket). Over the
// life of the budget, ratio retries never exceed Ratio times all requests, so
// amplification stays at most 1+Ratio plus the floor. And at every ratio
// grant at t, ratioRetries(W(t)) <= Ratio*requests(W(t)). No budget can bound
// the retries of a window by the requests of that same window alone: a retry
// follows the request it retries, so the requests that funded a window's
// retries may lie in the window before; hence "a-Window".
//
// Times that go backwards are treated as the latest time seen. OnSuccess is
// ignored; Available reports the retries grantable now (ratio credit plus
// floor tokens). A Ratio is safe for concurrent use (a mutex guards the
// counters) and starts no goroutines. Create it with [NewRatio]; the zero
// value is not usable.
type Ratio struct {
	ppm   int64         // ratio in parts per million
	width time.Duration // of one sub-bucket
	floor *rate.Limiter

	mu       sync.Mutex
	started  bool
	origin   time.Time // first time seen; sub-bucket 0 starts here
	latest   time.Time // latest time seen; what the floor limiter is given
	head     int64     // index of the newest sub-bucket
	requests []int64   // per sub-bucket, ring indexed by index % len
	retries  []int64   // ratio-funded grants per sub-bucket
	sumReq   int64     // sum of requests over the window
	sumRet   int64     // sum of retries over the window
}

var _ Budget = (*Ratio)(nil)

// NewRatio returns a ratio budget configured by c, zero fields meaning the
// defaults (20% of requests over a 10 s window of 10 sub-buckets, plus a floor
// of 10 retries per second with a burst of 10). It never fails: a value
// Validate refuses means what [RatioConfig] says (use Validate to reject it
// instead).
func NewRatio(c RatioConfig) *Ratio {
	ratio := c.Ratio
	switch {
	case c.Window < 0 || c.Buckets < 0 || ratio < 0 || math.IsNaN(ratio):
		ratio = 0 // no ratio credit: the floor alone
	case ratio == 0:
		ratio = defaultRatio
	}
	ratio = min(ratio, maxRatio)
	window := c.Window
	if window <= 0 {
		window = defaultWindow
	}
	n := c.Buckets
	if n <= 0 {
		n = defaultBuckets
	}
	if int64(n) > int64(window) {
		n = int(window) // at least one nanosecond per sub-bucket
	}
	perSec, burst := c.FloorPerSecond, c.FloorBurst
	if perSec == 0 {
		perSec = defaultFloorPerSecond
	}
	switch {
	case !(perSec > 0) || math.IsInf(perSec, 1) || burst < 0: // negative, NaN, infinite
		perSec, burst = 0, 0 // no floor: a zero burst allows nothing
	case burst == 0:
		burst = int(math.Ceil(min(perSec, math.MaxInt32)))
	}
	return &Ratio{
		ppm:      int64(math.Round(ratio * ppmScale)),
		width:    window / time.Duration(n),
		floor:    rate.NewLimiter(rate.Limit(perSec), burst),
		requests: make([]int64, n),
		retries:  make([]int64, n),
	}
}

// advance moves the window to now and returns the ring slot of now's
// sub-bucket; it also advances r.latest, so that the floor limiter never
// sees time go backwards (x/time/rate would then over-refill). r.mu must be held.
func (r *Ratio) advance(now time.Time) int {
	n := int64(len(r.requests))
	if !r.started {
		r.started, r.origin, r.latest, r.head = true, now, now, 0
		return 0
	}
	if now.After(r.latest) {
		r.latest = now
	}
	idx := int64(now.Sub(r.origin) / r.width) // Sub saturates: no overflow
	if idx <= r.head {
		return int(r.head % n) // same sub-bucket, or time went backwards
	}
	if idx-r.head >= n {
		clear(r.requests)
		clear(r.retries)
		r.sumReq, r.sumRet = 0, 0
	} else {
		for i := r.head + 1; i <= idx; i++ {
			s := i % n
			r.sumReq -= r.requests[s]
			r.sumRet -= r.retries[s]
			r.requests[s], r.retries[s] = 0, 0
		}
	}
	r.head = idx
	return int(idx % n)
}

// credit returns how many more ratio-funded retries the window allows.
// r.mu must be held.
func (r *Ratio) credit() int64 {
	if r.ppm == 0 {
		return 0 // no ratio credit (a ratio below one part per million included)
	}
	if r.sumReq > math.MaxInt64/r.ppm {
		return math.MaxInt64 // more requests than any int64 retry count could use
	}
	return max(0, r.sumReq*r.ppm/ppmScale-r.sumRet)
}

// OnRequest counts one logical request in now's sub-bucket. Safe for
// concurrent use.
func (r *Ratio) OnRequest(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.advance(now)
	if r.sumReq == math.MaxInt64 {
		return
	}
	r.requests[s]++
	r.sumReq++
}

// AcquireRetry grants a retry (cost 1) from the ratio credit of the window
// at now, else from the floor limiter; otherwise it returns (0, false) and
// takes nothing. k is ignored: every retry counts 1. Safe for concurrent use.
func (r *Ratio) AcquireRetry(now time.Time, _ bool) (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.advance(now)
	if r.credit() >= 1 {
		r.retries[s]++
		r.sumRet++
		return 1, true
	}
	if r.floor.AllowN(r.latest, 1) {
		return 1, true
	}
	return 0, false
}

// Refund gives one ratio-funded retry back to the window at now when cost
// is positive and the window still counts one (the newest sub-bucket that
// does); a retry the floor granted, or one whose sub-bucket has left the
// window, gives nothing back. Safe for concurrent use.
func (r *Ratio) Refund(now time.Time, cost int) {
	if cost <= 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.advance(now)
	n := int64(len(r.retries))
	for i := r.head; i > r.head-n && i >= 0; i-- {
		if s := i % n; r.retries[s] > 0 {
			r.retries[s]--
			r.sumRet--
			return
		}
	}
}

// OnSuccess does nothing: a ratio budget counts requests, not outcomes.
func (r *Ratio) OnSuccess(time.Time, int) {}

// Available returns the retries AcquireRetry would grant at now if asked
// repeatedly: the window's remaining ratio credit plus the floor's whole
// tokens, saturated at math.MaxInt. Safe for concurrent use.
func (r *Ratio) Available(now time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.advance(now)
	c := r.credit()
	f := int64(max(0, math.Floor(r.floor.TokensAt(r.latest))))
	if c > math.MaxInt-f {
		return math.MaxInt
	}
	return int(c + f)
}
