package jitter

import (
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Defaults applied by [Config.Backoff] to zero fields.
const (
	defaultBase         = 50 * time.Millisecond // transient failures: 5xx, resets, timeouts
	defaultThrottleBase = 1 * time.Second       // throttling: 429, or 503 asking for a wait
	defaultCap          = 20 * time.Second      // the largest wait
)

// Config selects a backoff formula and its parameters. The zero value is
// ready to use: each zero field means its default. A negative duration is
// not a default in disguise: it means what it means to [NewBackOff] (a
// negative base counts as 0, a cap <= 0 means no cap). A Config is a plain
// value, safe to copy and to use from many goroutines.
type Config struct {
	// Func is the formula; nil means Full.
	Func Func
	// Base is the base for transient failures (5xx, resets, timeouts).
	// 0 means 50 ms; a negative value means 0: no wait.
	Base time.Duration
	// ThrottleBase is the base when the server throttles (429, or 503
	// asking for a wait above 0 in Retry-After or RateLimit). 0 means 1 s;
	// a negative value means 0: no wait beyond the server's.
	ThrottleBase time.Duration
	// Cap is the largest wait. 0 means 20 s; a negative value means no
	// cap (the largest time.Duration): the overall deadline still bounds
	// the waits of the saferetry Transport.
	Cap time.Duration
}

// withDefaults returns c with every zero field replaced by its default and
// every negative one by its meaning.
func (c Config) withDefaults() Config {
	if c.Func == nil {
		c.Func = Full
	}
	c.Base = durationOr(c.Base, defaultBase, 0)
	c.ThrottleBase = durationOr(c.ThrottleBase, defaultThrottleBase, 0)
	c.Cap = durationOr(c.Cap, defaultCap, maxDuration)
	return c
}

// durationOr returns d when it is positive, def when it is 0, and neg when
// it is negative.
func durationOr(d, def, neg time.Duration) time.Duration {
	switch {
	case d == 0:
		return def
	case d < 0:
		return neg
	}
	return d
}

// Backoff returns the wait before retry number attempt (0 for the first
// retry) after applying the defaults and meanings documented on [Config]. prev is the wait
// returned for the previous retry (used by [Decorrelated]); throttle selects
// ThrottleBase instead of Base (the caller sets it as retry.Decision.Throttle
// says: for 429, or 503 asking for a wait); r is a uniform random value in
// [0, 1), clamped into that range when outside it. The result is never
// negative and never exceeds the cap.
// Backoff is pure, never panics and is safe for concurrent use.
func (c Config) Backoff(attempt int, prev time.Duration, throttle bool, r float64) time.Duration {
	c = c.withDefaults()
	base := c.Base
	if throttle {
		base = c.ThrottleBase
	}
	d := c.Func(attempt, prev, base, c.Cap, r)
	// Guard against user-supplied formulas that misbehave.
	return max(0, min(d, c.Cap))
}

// backOff adapts a Func to backoff.BackOff.
type backOff struct {
	f         Func
	base, cap time.Duration
	rnd       func() float64
	attempt   int
	prev      time.Duration
}

var _ backoff.BackOff = (*backOff)(nil)

// NewBackOff adapts formula f to github.com/cenkalti/backoff/v4's BackOff
// interface, so the formulas can drive backoff.Retry and friends. Each
// NextBackOff call returns f(attempt, prev, base, cap, rnd()) for attempt
// 0, 1, 2, ... and remembers the result as prev; Reset starts over at
// attempt 0 with prev 0.
//
// f nil means [Full]; rnd nil means math/rand/v2's Float64; cap <= 0 means
// uncapped (largest time.Duration); a negative base counts as 0. No defaults
// from [Config] are applied. The returned BackOff never returns backoff.Stop:
// bound it with backoff.WithMaxRetries or backoff.WithContext. Like the
// backoff/v4 implementations, it is not safe for concurrent use; rnd is
// called from the goroutine that calls NextBackOff.
func NewBackOff(f Func, base, cap time.Duration, rnd func() float64) backoff.BackOff {
	if f == nil {
		f = Full
	}
	if rnd == nil {
		rnd = rand.Float64
	}
	return &backOff{f: f, base: base, cap: cap, rnd: rnd}
}

// NextBackOff returns the next wait; it never returns backoff.Stop.
func (b *backOff) NextBackOff() time.Duration {
	d := max(0, b.f(b.attempt, b.prev, b.base, b.cap, b.rnd()))
	if b.attempt < int(^uint(0)>>1) {
		b.attempt++
	}
	b.prev = d
	return d
}

// Reset restarts the sequence at attempt 0 with no previous wait.
func (b *backOff) Reset() {
	b.attempt = 0
	b.prev = 0
}
