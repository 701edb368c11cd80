package jitter_test

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/saferetry/saferetry/jitter"
)

func ExampleFull() {
	base, cap := 50*time.Millisecond, 20*time.Second
	// r comes from the caller's random source; fixed here for a stable output.
	for attempt := range 4 {
		fmt.Println(jitter.Full(attempt, 0, base, cap, 0.5))
	}
	fmt.Println(jitter.Full(1000, 0, base, cap, 0.5)) // capped, no overflow
	// Output:
	// 25ms
	// 50ms
	// 100ms
	// 200ms
	// 10s
}

func ExampleDecorrelated() {
	base, cap := 100*time.Millisecond, 10*time.Second
	prev := time.Duration(0)
	for range 3 {
		prev = jitter.Decorrelated(0, prev, base, cap, 0.5)
		fmt.Println(prev)
	}
	// Output:
	// 200ms
	// 350ms
	// 575ms
}

func ExampleConfig_Backoff() {
	var c jitter.Config // Full jitter, 50ms transient base, 1s throttling base, 20s cap
	fmt.Println(c.Backoff(0, 0, false, 0.5))
	fmt.Println(c.Backoff(0, 0, true, 0.5))
	fmt.Println(c.Backoff(30, 0, true, 0.5))
	// Output:
	// 25ms
	// 500ms
	// 10s
}

func ExampleNewBackOff() {
	rng := rand.New(rand.NewPCG(1, 1)) // seeded for the example; nil uses math/rand/v2
	b := backoff.WithMaxRetries(jitter.NewBackOff(jitter.Full, time.Nanosecond, time.Microsecond, rng.Float64), 3)
	calls := 0
	err := backoff.Retry(func() error {
		calls++
		return fmt.Errorf("attempt %d failed", calls)
	}, b)
	fmt.Println(calls, err)
	// Output:
	// 4 attempt 4 failed
}

// go-retryablehttp's LinearJitterBackoff(min, max) as a Func: a random wait
// between min (Base) and max (Cap), times the retry's number. Results above
// Cap are cut to Cap by Config.Backoff.
func ExampleFunc_linearJitter() {
	linear := func(n int, _, base, cap time.Duration, r float64) time.Duration {
		return time.Duration((float64(base) + r*float64(cap-base)) * float64(n+1))
	}
	c := jitter.Config{Func: linear, Base: time.Second, Cap: 30 * time.Second}
	for n := range 3 {
		fmt.Println(c.Backoff(n, 0, false, 0.1))
	}
	// Output:
	// 3.9s
	// 7.8s
	// 11.7s
}
