package unixnano

import (
	"math"
	"testing"
	"time"
)

func TestOfAndTime(t *testing.T) {
	at := time.Date(2026, 12, 1, 23, 0, 0, 123, time.UTC)
	for _, tc := range []struct {
		in   time.Time
		want int64
	}{
		{time.Time{}, 0},
		{at, at.UnixNano()},
		{at.In(time.FixedZone("x", 3600)), at.UnixNano()},
		{time.Date(1600, 1, 1, 0, 0, 0, 0, time.UTC), math.MinInt64 + 1},
		{time.Date(2300, 1, 1, 0, 0, 0, 0, time.UTC), math.MaxInt64},
		{Min, math.MinInt64 + 1},
		{Max, math.MaxInt64},
	} {
		if got := Of(tc.in); got != tc.want {
			t.Errorf("Of(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
	if !Time(0).IsZero() {
		t.Errorf("Time(0) = %v, want the zero time", Time(0))
	}
	if got := Time(at.UnixNano()); !got.Equal(at) || got.Location() != time.UTC {
		t.Errorf("Time(%d) = %v, want %v in UTC", at.UnixNano(), got, at)
	}
}

func TestAddSaturates(t *testing.T) {
	at := time.Date(2026, 12, 1, 23, 0, 0, 123, time.UTC)
	for _, tc := range []struct {
		t    time.Time
		d    time.Duration
		want int64
	}{
		{at, time.Second, at.UnixNano() + int64(time.Second)},
		{at, -24 * time.Hour, at.UnixNano() - int64(24*time.Hour)},
		{at, math.MaxInt64, math.MaxInt64},
		{at, math.MinInt64, at.UnixNano() + math.MinInt64},
		{Max, 1, math.MaxInt64},
		{Max, -1, math.MaxInt64 - 1},
		{Min, -1, math.MinInt64 + 1},
		{Min, math.MinInt64, math.MinInt64 + 1},
		{time.Unix(0, -1), math.MinInt64, math.MinInt64 + 1},
		{time.Time{}, time.Second, int64(time.Second)},
	} {
		if got := Add(tc.t, tc.d); got != tc.want {
			t.Errorf("Add(%v, %v) = %d, want %d", tc.t, tc.d, got, tc.want)
		}
	}
}
