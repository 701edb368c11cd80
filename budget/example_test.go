package budget_test

import (
	"fmt"
	"time"

	"github.com/saferetry/saferetry/budget"
)

// A transient retry costs 14 tokens, a throttling retry 5; a retry that
// succeeds gets its cost back and a first-try success adds 1.
func ExampleTokenBucket() {
	now := time.Now()
	b := budget.NewTokenBucket(budget.TokenBucketConfig{}) // 500 tokens
	cost, ok := b.AcquireRetry(now, false)                 // after a transient failure
	fmt.Println(cost, ok, b.Available(now))
	cost, ok = b.AcquireRetry(now, true) // after throttling
	fmt.Println(cost, ok, b.Available(now))
	b.OnSuccess(now, cost) // the throttled retry succeeded: refund
	b.OnSuccess(now, 0)    // another request succeeded on its first try
	fmt.Println(b.Available(now))
	// Output:
	// 14 true 486
	// 5 true 481
	// 487
}

// During a full outage the bucket drains after 35 transient retries; from
// then on each failing request is sent once.
func ExampleTokenBucket_outage() {
	now := time.Now()
	b := budget.NewTokenBucket(budget.TokenBucketConfig{})
	retries := 0
	for range 1000 {
		b.OnRequest(now)
		if _, ok := b.AcquireRetry(now, false); ok {
			retries++
		}
	}
	fmt.Printf("1000 failing requests, %d retries, amplification %.3f\n", retries, float64(1000+retries)/1000)
	// Output: 1000 failing requests, 35 retries, amplification 1.035
}

// A ratio budget lets 20% of the window's requests be retried, plus a floor
// of 10 retries per second (here disabled to show the ratio alone).
func ExampleRatio() {
	now := time.Now()
	r := budget.NewRatio(budget.RatioConfig{Ratio: 0.2, Window: 10 * time.Second, FloorPerSecond: -1})
	for range 50 {
		r.OnRequest(now)
	}
	granted := 0
	for range 50 {
		if _, ok := r.AcquireRetry(now, false); ok {
			granted++
		}
	}
	fmt.Println(granted, r.Available(now))
	// Output: 10 0
}

// A registry gives each host its own budget, so an outage of one host does
// not spend the retries of another.
func ExampleRegistry() {
	now := time.Now()
	reg := budget.NewRegistry(nil) // default token buckets
	for range 100 {
		reg.For("flaky.example").AcquireRetry(now, false)
	}
	fmt.Println(reg.For("flaky.example").Available(now), reg.For("healthy.example").Available(now))
	// Output: 10 500
}

// Time refills a drained bucket: 500 tokens a minute by default, so a
// transient retry is affordable again within 1.7 s, and with no traffic
// the bucket is full again within a minute. RefillTime -1 is the AWS SDKs'
// bucket, which only successes refill.
func ExampleTokenBucket_recovery() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, c := range []budget.TokenBucketConfig{{}, {RefillTime: -1}} {
		b := budget.NewTokenBucket(c)
		for range 100 { // an outage drains it
			b.AcquireRetry(now, false)
		}
		fmt.Println(b.Available(now), b.Available(now.Add(1700*time.Millisecond)), b.Available(now.Add(time.Minute)))
	}
	// Output:
	// 10 24 500
	// 10 10 10
}
