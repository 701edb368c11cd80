package deadline

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func TestOverall(t *testing.T) {
	bg := context.Background()
	early, cancel1 := context.WithDeadline(bg, t0.Add(5*time.Second))
	defer cancel1()
	late, cancel2 := context.WithDeadline(bg, t0.Add(time.Hour))
	defer cancel2()

	cases := []struct {
		name string
		ctx  context.Context
		max  time.Duration
		want time.Time
	}{
		{"no ctx deadline, default", bg, 0, t0.Add(DefaultMaxElapsed)},
		{"negative max means default", bg, -time.Second, t0.Add(30 * time.Second)},
		{"explicit max", bg, 10 * time.Second, t0.Add(10 * time.Second)},
		{"ctx earlier wins", early, 10 * time.Second, t0.Add(5 * time.Second)},
		{"max earlier wins", late, 10 * time.Second, t0.Add(10 * time.Second)},
		{"ctx earlier than default", early, 0, t0.Add(5 * time.Second)},
		{"nil ctx", nil, time.Second, t0.Add(time.Second)},
		{"huge max", bg, time.Duration(math.MaxInt64), t0.Add(time.Duration(math.MaxInt64))},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Overall(c.ctx, t0, c.max)
			require.True(t, c.want.Equal(got), "got %v want %v", got, c.want)
			require.False(t, got.IsZero())
		})
	}
}

func TestRemaining(t *testing.T) {
	overall := t0.Add(2 * time.Second)
	require.Equal(t, 2*time.Second, Remaining(t0, overall))
	require.Equal(t, time.Millisecond, Remaining(overall.Add(-time.Millisecond), overall))
	require.Equal(t, time.Duration(0), Remaining(overall, overall))
	require.Equal(t, time.Duration(0), Remaining(overall.Add(time.Hour), overall))
	require.Equal(t, time.Duration(math.MaxInt64), Remaining(t0, time.Time{}))
	// Far apart times saturate instead of wrapping.
	require.Equal(t, time.Duration(math.MaxInt64), Remaining(time.Time{}.Add(time.Nanosecond), t0.AddDate(500, 0, 0)))
}

func TestAttemptTimeout(t *testing.T) {
	overall := t0.Add(10 * time.Second)
	cases := []struct {
		name       string
		now        time.Time
		overall    time.Time
		perAttempt time.Duration
		want       time.Duration
	}{
		{"per-attempt smaller", t0, overall, 2 * time.Second, 2 * time.Second},
		{"time left smaller", t0.Add(9 * time.Second), overall, 2 * time.Second, time.Second},
		{"equal", t0.Add(8 * time.Second), overall, 2 * time.Second, 2 * time.Second},
		{"per-attempt off", t0.Add(3 * time.Second), overall, 0, 7 * time.Second},
		{"negative per-attempt is off", t0, overall, -time.Second, 10 * time.Second},
		{"deadline passed", t0.Add(11 * time.Second), overall, 2 * time.Second, 0},
		{"deadline passed, off", t0.Add(11 * time.Second), overall, 0, 0},
		{"at deadline", overall, overall, time.Second, 0},
		{"no overall, per-attempt", t0, time.Time{}, 3 * time.Second, 3 * time.Second},
		{"no overall, off", t0, time.Time{}, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, AttemptTimeout(c.now, c.overall, c.perAttempt))
		})
	}
}

func TestSleepFits(t *testing.T) {
	overall := t0.Add(time.Second)
	cases := []struct {
		name    string
		now     time.Time
		overall time.Time
		wait    time.Duration
		want    bool
	}{
		{"fits", t0, overall, 500 * time.Millisecond, true},
		{"just fits", t0, overall, time.Second - time.Nanosecond, true},
		{"ends exactly at deadline", t0, overall, time.Second, false},
		{"ends after", t0, overall, 2 * time.Second, false},
		{"zero wait before deadline", t0, overall, 0, true},
		{"zero wait at deadline", overall, overall, 0, false},
		{"negative wait", t0, overall, -time.Hour, true},
		{"negative wait after deadline", overall.Add(time.Second), overall, -time.Hour, false},
		{"huge wait", t0, overall, time.Duration(math.MaxInt64), false},
		{"no overall", t0, time.Time{}, time.Duration(math.MaxInt64), true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, SleepFits(c.now, c.overall, c.wait))
		})
	}
}
