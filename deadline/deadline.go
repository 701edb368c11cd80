package deadline

import (
	"context"
	"math"
	"time"
)

// DefaultMaxElapsed is the longest a whole logical request (every attempt
// and every sleep) may take when the caller sets no bound of its own.
const DefaultMaxElapsed = 30 * time.Second

// Overall returns the deadline of a whole logical request that starts at
// start: the earlier of ctx's deadline (if any) and start + maxElapsed.
// A maxElapsed of zero or less means [DefaultMaxElapsed]; a nil ctx counts as
// one without a deadline. The result is never the zero time. Safe for
// concurrent use; it does not fail.
func Overall(ctx context.Context, start time.Time, maxElapsed time.Duration) time.Time {
	if maxElapsed <= 0 {
		maxElapsed = DefaultMaxElapsed
	}
	overall := start.Add(maxElapsed)
	if ctx != nil {
		if d, ok := ctx.Deadline(); ok && d.Before(overall) {
			overall = d
		}
	}
	return overall
}

// Remaining returns the time left before overall at now: overall - now,
// and 0 once the deadline has passed (never negative). A zero overall means
// "no deadline" and gives math.MaxInt64 (about 292 years). Safe for
// concurrent use.
func Remaining(now, overall time.Time) time.Duration {
	if overall.IsZero() {
		return time.Duration(math.MaxInt64)
	}
	left := overall.Sub(now) // saturates instead of overflowing
	if left < 0 {
		return 0
	}
	return left
}

// AttemptTimeout returns the timeout for one attempt that starts at now:
// the smaller of perAttempt and the time left before overall.
//
//   - perAttempt <= 0 means no per-attempt timeout: the result is the time
//     left.
//   - A zero overall means no overall deadline: the result is perAttempt
//     when it is positive, and 0 (no timeout at all) otherwise.
//   - With a non-zero overall, the result is never "off": 0 means the
//     deadline has passed and no attempt should start (context.WithTimeout
//     with 0 gives a context that is already done).
//
// Safe for concurrent use; it does not fail.
func AttemptTimeout(now, overall time.Time, perAttempt time.Duration) time.Duration {
	if overall.IsZero() {
		if perAttempt > 0 {
			return perAttempt
		}
		return 0
	}
	left := Remaining(now, overall)
	if perAttempt > 0 && perAttempt < left {
		return perAttempt
	}
	return left
}

// SleepFits reports whether a sleep of wait starting at now ends strictly
// before overall, that is whether there would still be time for another
// attempt after it. A negative wait counts as zero; a zero overall means no
// deadline, so every sleep fits. Safe for concurrent use.
func SleepFits(now, overall time.Time, wait time.Duration) bool {
	if overall.IsZero() {
		return true
	}
	if wait < 0 {
		wait = 0
	}
	return wait < overall.Sub(now)
}
