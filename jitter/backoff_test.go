package jitter

import (
	"errors"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/stretchr/testify/require"
)

// instantTimer is a backoff.Timer that fires at once and records the waits
// it was asked for, so no test sleeps.
type instantTimer struct {
	c     chan time.Time
	waits []time.Duration
}

func newInstantTimer() *instantTimer { return &instantTimer{c: make(chan time.Time, 1)} }

func (t *instantTimer) Start(d time.Duration) {
	t.waits = append(t.waits, d)
	t.c <- time.Time{}
}
func (t *instantTimer) Stop()               {}
func (t *instantTimer) C() <-chan time.Time { return t.c }

// seq returns a rnd function yielding vals in order, then repeating the last.
func seq(vals ...float64) func() float64 {
	i := 0
	return func() float64 {
		v := vals[min(i, len(vals)-1)]
		i++
		return v
	}
}

func TestNewBackOffSequenceAndReset(t *testing.T) {
	b := NewBackOff(Full, 100*ms, time.Second, seq(0.5))
	want := []time.Duration{50 * ms, 100 * ms, 200 * ms, 400 * ms, 500 * ms, 500 * ms}
	for i, w := range want {
		require.Equal(t, w, b.NextBackOff(), "call %d", i)
	}
	b.Reset()
	require.Equal(t, 50*ms, b.NextBackOff(), "Reset restarts at attempt 0")
}

func TestNewBackOffDecorrelatedFeedsPrev(t *testing.T) {
	b := NewBackOff(Decorrelated, 100*ms, 10*time.Second, seq(0.5))
	// prev=base: 100+0.5*(300-100)=200; prev=200: 100+0.5*(600-100)=350;
	// prev=350: 100+0.5*(1050-100)=575
	require.Equal(t, 200*ms, b.NextBackOff())
	require.Equal(t, 350*ms, b.NextBackOff())
	require.Equal(t, 575*ms, b.NextBackOff())
	b.Reset()
	require.Equal(t, 200*ms, b.NextBackOff(), "Reset forgets prev")
}

func TestNewBackOffDefaults(t *testing.T) {
	b := NewBackOff(nil, 100*ms, 0, nil) // Full, uncapped, math/rand/v2
	for i := 0; i < 200; i++ {
		d := b.NextBackOff()
		require.NotEqual(t, backoff.Stop, d)
		require.GreaterOrEqual(t, d, time.Duration(0))
	}
}

func TestNewBackOffInsideRetry(t *testing.T) {
	errTransient := errors.New("transient")
	timer := newInstantTimer()
	calls := 0
	op := func() error {
		calls++
		return errTransient
	}
	b := backoff.WithMaxRetries(NewBackOff(Full, 10*ms, 50*ms, seq(0.5)), 4)
	err := backoff.RetryNotifyWithTimer(op, b, nil, timer)
	require.ErrorIs(t, err, errTransient)
	require.Equal(t, 5, calls, "1 try + 4 retries")
	require.Equal(t, []time.Duration{5 * ms, 10 * ms, 20 * ms, 25 * ms}, timer.waits)

	// Succeeds on the third call: two waits, and Retry resets the BackOff first.
	calls = 0
	timer = newInstantTimer()
	err = backoff.RetryNotifyWithTimer(func() error {
		calls++
		if calls < 3 {
			return errTransient
		}
		return nil
	}, b, nil, timer)
	require.NoError(t, err)
	require.Equal(t, 3, calls)
	require.Equal(t, []time.Duration{5 * ms, 10 * ms}, timer.waits)

	// A permanent error stops at once.
	calls = 0
	err = backoff.RetryNotifyWithTimer(func() error { calls++; return backoff.Permanent(errTransient) }, b, nil, newInstantTimer())
	require.ErrorIs(t, err, errTransient)
	require.Equal(t, 1, calls)
}

func TestNewBackOffHugeAttemptCount(t *testing.T) {
	b := NewBackOff(None, time.Second, 0, seq(0)).(*backOff)
	b.attempt = int(^uint(0) >> 1) // MaxInt: the counter must saturate, not wrap
	require.Equal(t, maxDuration, b.NextBackOff())
	require.Equal(t, maxDuration, b.NextBackOff())
	require.Equal(t, int(^uint(0)>>1), b.attempt)
}
