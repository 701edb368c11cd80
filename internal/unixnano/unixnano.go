// Package unixnano converts times to and from the int64 Unix nanoseconds the
// SQL and Redis stores keep, and adds durations to them, saturating where
// int64 ends.
package unixnano

import (
	"math"
	"time"
)

// Min and Max are the earliest and the latest times Of keeps exactly.
var (
	Min = time.Unix(0, math.MinInt64+1)
	Max = time.Unix(0, math.MaxInt64)
)

// Of returns t as Unix nanoseconds, 0 for the zero time, saturating at Min
// and Max outside the years 1678-2262 that int64 nanoseconds can hold.
func Of(t time.Time) int64 {
	switch {
	case t.IsZero():
		return 0
	case t.Before(Min):
		return math.MinInt64 + 1
	case t.After(Max):
		return math.MaxInt64
	}
	return t.UnixNano()
}

// Add returns Of(t) + d, saturating at the bounds Of keeps: MinInt64+1
// and MaxInt64.
func Add(t time.Time, d time.Duration) int64 {
	n := Of(t)
	r := n + int64(d)
	switch {
	case d > 0 && r < n:
		return math.MaxInt64
	case d < 0 && (r > n || r == math.MinInt64):
		return math.MinInt64 + 1
	}
	return r
}

// Time returns the UTC time of n Unix nanoseconds, the zero time for 0.
func Time(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}
