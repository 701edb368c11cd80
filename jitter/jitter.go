package jitter

import (
	"math"
	"time"
)

// maxDuration is the largest representable time.Duration; formulas saturate
// at it instead of overflowing.
const maxDuration = time.Duration(math.MaxInt64)

// Func is a backoff formula: it returns how long to wait before retry number
// attempt (0 for the first retry, i.e. before the second attempt).
//
// prev is the wait returned for the previous retry (0 before the first),
// base the initial wait, cap the largest wait (cap <= 0 means uncapped, i.e.
// capped at the largest time.Duration), and r a uniformly distributed random
// value in [0, 1); values outside that range (and NaN) are clamped into it.
// A Func must be pure, safe for concurrent use, never panic and never return
// a negative duration. Full, Equal, Decorrelated and None are Funcs.
type Func func(attempt int, prev, base, cap time.Duration, r float64) time.Duration

// clampR maps r into [0, 1): NaN and negatives become 0, values >= 1 become
// the largest float64 below 1.
func clampR(r float64) float64 {
	switch {
	case r >= 1:
		return math.Nextafter(1, 0)
	case r > 0:
		return r
	default: // r <= 0 or NaN
		return 0
	}
}

// normalize turns non-positive caps into "uncapped" and negative bases into 0.
func normalize(base, cap time.Duration) (time.Duration, time.Duration) {
	if base < 0 {
		base = 0
	}
	if cap <= 0 {
		cap = maxDuration
	}
	return base, cap
}

// exponential returns min(cap, base*2^attempt) without overflowing.
func exponential(attempt int, base, cap time.Duration) time.Duration {
	base, cap = normalize(base, cap)
	if attempt < 0 {
		attempt = 0
	}
	if base == 0 {
		return 0
	}
	if base >= cap {
		return cap
	}
	// base*2^attempt > cap  <=>  base > cap>>attempt (for attempt < 63).
	if attempt >= 63 || base > cap>>uint(attempt) {
		return cap
	}
	return base << uint(attempt)
}

// scale returns r*d for r in [0, 1), never exceeding d.
func scale(d time.Duration, r float64) time.Duration {
	v := r * float64(d)
	if v >= float64(d) { // float64(d) may round up; keep the result <= d
		return d
	}
	return time.Duration(v)
}

// Full is the "full jitter" formula and the default:
//
//	sleep = random_between(0, min(cap, base * 2^attempt))
//	      = r * min(cap, base * 2^attempt)
//
// The result lies in [0, min(cap, base*2^attempt)); prev is ignored.
// Negative attempts count as 0, a negative base as 0, cap <= 0 as uncapped;
// r is clamped into [0, 1). Full is pure and safe for concurrent use.
func Full(attempt int, prev, base, cap time.Duration, r float64) time.Duration {
	return scale(exponential(attempt, base, cap), clampR(r))
}

// Equal is the "equal jitter" formula:
//
//	temp  = min(cap, base * 2^attempt)
//	sleep = temp/2 + random_between(0, temp/2)
//	      = temp/2 + r * temp/2
//
// The result lies in [temp-temp/2, temp) (temp when temp <= 1ns); prev is
// ignored. It keeps a minimum wait but Brooker found it does more work than
// [Full]; it exists for comparison and simulation. Argument handling matches [Full]. Equal is pure
// and safe for concurrent use.
func Equal(attempt int, prev, base, cap time.Duration, r float64) time.Duration {
	temp := exponential(attempt, base, cap)
	half := temp / 2
	return temp - half + scale(half, clampR(r))
}

// Decorrelated is the "decorrelated jitter" formula:
//
//	sleep = min(cap, random_between(base, prev * 3))
//	      = min(cap, base + r * (3*prev - base))      with prev = max(prev, base)
//
// attempt is ignored: the growth comes from feeding the previous result back
// as prev (0 or anything below base before the first retry means base).
// The result lies in [min(base, cap), cap]. A negative base counts as 0
// (which makes every result 0), cap <= 0 as uncapped; 3*prev saturates
// instead of overflowing and r is clamped into [0, 1). Decorrelated is pure
// and safe for concurrent use.
func Decorrelated(attempt int, prev, base, cap time.Duration, r float64) time.Duration {
	base, cap = normalize(base, cap)
	if prev < base {
		prev = base
	}
	upper := maxDuration
	if prev <= maxDuration/3 {
		upper = prev * 3
	}
	d := base + scale(upper-base, clampR(r)) // upper-base >= 0 and base+(upper-base) <= maxDuration
	return min(d, cap)
}

// None is capped exponential backoff without jitter:
//
//	sleep = min(cap, base * 2^attempt)
//
// prev and r are ignored. Clients using it retry in synchronised waves, so it
// exists only for comparison and simulation. Argument handling matches
// [Full]. None is pure and safe for concurrent use.
func None(attempt int, prev, base, cap time.Duration, r float64) time.Duration {
	return exponential(attempt, base, cap)
}
