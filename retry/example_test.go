package retry_test

import (
	"errors"
	"fmt"
	"net/http"
	"syscall"
	"time"

	"github.com/saferetry/saferetry/retry"
)

func ExampleClassify() {
	now := time.Now()
	throttled := &http.Response{StatusCode: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"2"}}}
	d := retry.Classify(nil, retry.Input{Idempotent: true, Response: throttled}, now)
	fmt.Println(d.Retry, d.Class, d.Throttle, d.RetryAfter)

	// A POST without an idempotency key: a 503 is final, a refused connection is not.
	unavailable := &http.Response{StatusCode: http.StatusServiceUnavailable}
	d = retry.Classify(nil, retry.Input{Response: unavailable}, now)
	fmt.Println(d.Retry, d.Class)
	d = retry.Classify(nil, retry.Input{Err: syscall.ECONNREFUSED}, now)
	fmt.Println(d.Retry, d.Class, d.NeverSent)
	// Output:
	// true status_429 true 2s
	// false status_503
	// true conn_refused true
}

func ExampleExhaustedError() {
	err := error(&retry.ExhaustedError{Attempts: 3, Reason: retry.ReasonMaxAttempts, Err: syscall.ECONNREFUSED})
	fmt.Println(err)
	fmt.Println(errors.Is(err, retry.ErrExhausted), errors.Is(err, syscall.ECONNREFUSED))
	// Output:
	// saferetry: gave up after 3 attempts (max_attempts): connection refused
	// true true
}
