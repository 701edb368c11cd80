package saferetry

import (
	"context"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/retry"
)

// How long the server asks the Transport to wait before a retry, as a
// server says it: Retry-After, or the RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers, over a real http.Server (on
// in-memory pipes, in a synctest bubble whose clock makes every wait exact).

// firstAnswer answers first with status and the header fields given (name,
// value, name, value, ...), then 200.
func firstAnswer(status int, fields ...string) *script {
	return &script{statuses: []int{status, 200}, header: func(n int, h http.Header) {
		if n == 0 {
			for i := 0; i+1 < len(fields); i += 2 {
				h.Add(fields[i], fields[i+1])
			}
		}
	}}
}

// waitCall sends a GET through a bubble Transport (half jitter, the default
// bases) built with opts, and returns the server's waits and how the call
// ended.
func waitCall(t *testing.T, ctx context.Context, srv *script, opts ...Option) ([]time.Duration, CallDoneInfo) {
	t.Helper()
	base, url := pipeServer(t, srv)
	var done CallDoneInfo
	tr := newBubbleTransport(base, append(opts, WithObserver(Observer{
		CallDone: func(_ context.Context, info CallDoneInfo) { done = info },
	}))...)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	return srv.Waits(), done
}

// A spent quota (r=0) is waited out: t seconds before the retry.
func TestRateLimitSpentQuotaIsWaited(t *testing.T) {
	for _, status := range []int{http.StatusTooManyRequests, http.StatusServiceUnavailable} {
		synctest.Test(t, func(t *testing.T) {
			waits, done := waitCall(t, t.Context(), firstAnswer(status, "RateLimit", `"default";r=0;t=3`))
			assert.Equal(t, []time.Duration{3 * time.Second}, waits, "status %d", status)
			assert.Equal(t, 200, done.Response.StatusCode)
		})
	}
	synctest.Test(t, func(t *testing.T) {
		// No t: the window of the policy the quota belongs to.
		srv := firstAnswer(http.StatusTooManyRequests,
			"RateLimit", `"permin";r=0`, "RateLimit-Policy", `"permin";q=50;w=4`)
		waits, _ := waitCall(t, t.Context(), srv)
		assert.Equal(t, []time.Duration{4 * time.Second}, waits)
	})
}

// The wait is bounded as Retry-After's is: one longer than
// WithMaxRetryAfter, or that would end after the deadline, stops the loop
// at once with the server's answer.
func TestRateLimitWaitIsBoundedAsRetryAfterIs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		waits, done := waitCall(t, t.Context(), firstAnswer(http.StatusTooManyRequests, "RateLimit", `"d";r=0;t=31`))
		assert.Empty(t, waits)
		assert.Zero(t, time.Since(start), "no sleep at all")
		assert.Equal(t, retry.ReasonRetryAfterTooLong, done.Stop)
		assert.Equal(t, http.StatusTooManyRequests, done.Response.StatusCode)
	})
	synctest.Test(t, func(t *testing.T) {
		_, done := waitCall(t, t.Context(), firstAnswer(http.StatusServiceUnavailable, "RateLimit", `"d";r=0;t=3`),
			WithMaxRetryAfter(2*time.Second))
		assert.Equal(t, retry.ReasonRetryAfterTooLong, done.Stop, "WithMaxRetryAfter bounds it")
	})
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		defer cancel()
		start := time.Now()
		_, done := waitCall(t, ctx, firstAnswer(http.StatusServiceUnavailable, "RateLimit", `"d";r=0;t=3`))
		assert.Zero(t, time.Since(start), "no sleep in vain")
		assert.Equal(t, retry.ReasonDeadline, done.Stop)
	})
}

// Retry-After takes precedence; a malformed RateLimit field is ignored, and
// so is a quota that is not spent.
func TestRateLimitYieldsToRetryAfterAndIgnoresMalformedFields(t *testing.T) {
	for _, tc := range []struct {
		name   string
		srv    *script
		waited time.Duration
	}{
		{"Retry-After first", firstAnswer(http.StatusTooManyRequests,
			"Retry-After", "1", "RateLimit", `"d";r=0;t=30`), time.Second},
		{"a malformed RateLimit: the throttling backoff", firstAnswer(http.StatusTooManyRequests,
			"RateLimit", `"d";r=0;t=30s`), 500 * time.Millisecond},
		{"a quota left: the transient backoff", firstAnswer(http.StatusServiceUnavailable,
			"RateLimit", `"d";r=9;t=30`), 25 * time.Millisecond},
		{"a malformed Retry-After: the RateLimit wait", firstAnswer(http.StatusServiceUnavailable,
			"Retry-After", "soon", "RateLimit", `"d";r=0;t=2`), 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				waits, _ := waitCall(t, t.Context(), tc.srv)
				assert.Equal(t, []time.Duration{tc.waited}, waits)
			})
		})
	}
}

// A 503 asking for no wait ("Retry-After: 0", or a spent quota whose window
// is 0) waits no longer than a 503 asking nothing: Retry-After is a minimum,
// so 0 never switches to the throttling backoff.
func TestA503AskingForNoWaitCostsNoMoreThanNoHeader(t *testing.T) {
	waitsOf := func(fields ...string) (waits []time.Duration) {
		synctest.Test(t, func(t *testing.T) {
			srv := &script{statuses: []int{503, 503, 200}, header: func(n int, h http.Header) {
				for i := 0; i+1 < len(fields); i += 2 {
					h.Set(fields[i], fields[i+1])
				}
			}}
			waits, _ = waitCall(t, t.Context(), srv)
		})
		return waits
	}
	none := waitsOf()
	require.Equal(t, []time.Duration{25 * time.Millisecond, 50 * time.Millisecond}, none, "half the 50 ms base, doubled")
	assert.Equal(t, none, waitsOf("Retry-After", "0"))
	assert.Equal(t, none, waitsOf("RateLimit", `"d";r=0;t=0`))
	assert.Equal(t, []time.Duration{time.Second, time.Second}, waitsOf("Retry-After", "1"),
		"a wait above 0 is the server's minimum")
}
