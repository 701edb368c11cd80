package bench

import (
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"time"

	retrygo "github.com/avast/retry-go/v4"
	awsretry "github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/failsafe-go/failsafe-go/failsafehttp"
	"github.com/hashicorp/go-retryablehttp"

	"github.com/saferetry/saferetry"
)

// Waits selects the backoff waits of the peers.
type Waits int

const (
	// DefaultWaits keeps every contender's documented default backoff.
	DefaultWaits Waits = iota
	// ScaledWaits divides the peers' default waits by 1000 (their attempt
	// counts and retry predicates stay the defaults), so that failure
	// scenarios finish in seconds: go-retryablehttp waits 1 ms..30 ms
	// instead of 1 s..30 s, retry-go 100 us + 100 us jitter instead of
	// 100 ms + 100 ms. failsafe-go's default has no wait at all. saferetry
	// keeps its own defaults (50 ms full jitter): its waits are already
	// short and its budget does not depend on time.
	ScaledWaits
)

// Contender is one client under test: Wrap returns the RoundTripper the
// benchmark's http.Client uses, sending every attempt through base.
type Contender struct {
	Name string
	Wrap func(base http.RoundTripper, w Waits) http.RoundTripper
	// ClientTimeout is the http.Client's Timeout (0: none, as for every
	// contender but bare-timeout).
	ClientTimeout time.Duration
}

// DiscardLogger is the logger given to saferetry in every benchmark: its
// handler discards, so the per-attempt records cost only an Enabled check.
var DiscardLogger = slog.New(slog.DiscardHandler)

// Contenders lists the clients in the order they run in every round; bare
// comes first because benchstat compares every column to the first one.
//
// Configurations (each is the documented default unless noted):
//   - bare: base itself, no retries.
//   - retryablehttp: retryablehttp.NewClient() (4 retries, 1 s..30 s
//     exponential waits, DefaultRetryPolicy) used through
//     retryablehttp.RoundTripper, with HTTPClient replaced by an
//     http.Client over base, and Logger replaced by a log.Logger writing to
//     io.Discard (the default writes a line per request to stderr).
//   - failsafe: failsafehttp.NewRoundTripper(base,
//     failsafehttp.NewRetryPolicyBuilder().Build()): 2 retries, no delay
//     unless Retry-After.
//   - retrygo: retry-go has no HTTP integration; RetryGoTransport is the
//     small RoundTripper a user writes with retry.DoWithData and its
//     defaults (10 attempts, 100 ms backoff + 100 ms random jitter), plus
//     retry.Context(req.Context()).
//   - saferetry: saferetry.NewTransport(base,
//     saferetry.WithLogger(DiscardLogger)): every other setting is the
//     default, the process-wide per-host token bucket included.
var Contenders = []Contender{
	{Name: "bare", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper { return base }},
	{Name: "retryablehttp", Wrap: newRetryableHTTP},
	{Name: "failsafe", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return failsafehttp.NewRoundTripper(base, failsafehttp.NewRetryPolicyBuilder().Build())
	}},
	{Name: "retrygo", Wrap: func(base http.RoundTripper, w Waits) http.RoundTripper {
		return NewRetryGoTransport(base, w)
	}},
	{Name: "saferetry", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger))
	}},
}

// HappyVariants are extra contenders of the happy-path benchmark only: they
// show what a setting costs when nothing fails.
//   - saferetry-header: saferetry with WithDeadlineHeader(true), which sends
//     Request-Deadline-Ms on every request (a header map of its own per
//     attempt); by default it goes only with a context deadline, which these
//     requests do not have.
//   - bare-timeout: bare with http.Client.Timeout = 30 s (saferetry's
//     default MaxElapsed), as most callers of a bare transport run it:
//     every request then has a cancellable context with a deadline, which
//     turns on net/http's cancellation machinery, as saferetry's attempt
//     context does.
//   - saferetry-observer: saferetry with one Observer whose functions do
//     nothing: the cost of the observer mechanism.
//   - saferetry-otel: saferetry with otelsaferetry.ClientOptions over real
//     OpenTelemetry SDK providers (see newSafeRetryOTel): the cost of the
//     OTel instrumentation per request.
//   - aws-standard: the AWS SDK for Go v2's standard retryer
//     (AWSStandardTransport), the peer with the smallest price on the
//     happy path.
var HappyVariants = []Contender{
	{Name: "bare-timeout", ClientTimeout: 30 * time.Second, Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper { return base }},
	{Name: "aws-standard", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return &AWSStandardTransport{Base: base, Retryer: awsretry.NewStandard()}
	}},
	{Name: "saferetry-header", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger), saferetry.WithDeadlineHeader(true))
	}},
	{Name: "saferetry-observer", Wrap: newSafeRetryObserved},
	{Name: "saferetry-otel", Wrap: newSafeRetryOTel},
}

func newRetryableHTTP(base http.RoundTripper, w Waits) http.RoundTripper {
	c := retryablehttp.NewClient()
	c.HTTPClient = &http.Client{Transport: base}
	c.Logger = log.New(io.Discard, "", 0)
	if w == ScaledWaits {
		c.RetryWaitMin = time.Millisecond
		c.RetryWaitMax = 30 * time.Millisecond
	}
	return &retryablehttp.RoundTripper{Client: c}
}

// RetryGoTransport is the RoundTripper a retry-go user writes: each attempt
// goes to base; an error, a 429 or a 5xx other than 501 (the predicate the
// other two peers use) is retried; a retried response is drained and closed
// so its connection can be reused; the body of a retry comes from GetBody
// (a body without GetBody is not retried). It returns no response when the
// last attempt failed, only retry-go's error.
type RetryGoTransport struct {
	base http.RoundTripper
	opts []retrygo.Option
}

// NewRetryGoTransport returns a RetryGoTransport over base with retry-go's
// defaults, or scaled waits (see ScaledWaits).
func NewRetryGoTransport(base http.RoundTripper, w Waits) *RetryGoTransport {
	t := &RetryGoTransport{base: base}
	if w == ScaledWaits {
		t.opts = []retrygo.Option{retrygo.Delay(100 * time.Microsecond), retrygo.MaxJitter(100 * time.Microsecond)}
	}
	return t
}

var errNotRewindable = errors.New("request body cannot be rewound")

// StatusError is what RetryGoTransport returns to retry-go for a retryable
// status.
type StatusError struct{ Code int }

func (e *StatusError) Error() string { return fmt.Sprintf("status %d", e.Code) }

// RoundTrip implements http.RoundTripper.
func (t *RetryGoTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	n := 0
	opts := append([]retrygo.Option{retrygo.Context(req.Context())}, t.opts...)
	return retrygo.DoWithData(func() (*http.Response, error) {
		n++
		r := req
		if n > 1 && req.Body != nil && req.Body != http.NoBody {
			if req.GetBody == nil {
				return nil, retrygo.Unrecoverable(errNotRewindable)
			}
			body, err := req.GetBody()
			if err != nil {
				return nil, retrygo.Unrecoverable(err)
			}
			c := *req
			c.Body = body
			r = &c
		}
		resp, err := t.base.RoundTrip(r)
		if err != nil {
			return nil, err
		}
		if retryableStatus(resp.StatusCode) {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return nil, &StatusError{Code: resp.StatusCode}
		}
		return resp, nil
	}, opts...)
}

func retryableStatus(code int) bool {
	return code == http.StatusTooManyRequests || (code >= 500 && code != http.StatusNotImplemented)
}

// AWSStandardTransport is the retry loop of the AWS SDK for Go v2 (its
// retry middleware's steps) as a RoundTripper, over Retryer, which is
// retry.NewStandard() with its defaults: 3 attempts, exponential backoff
// with jitter up to 20 s, a retry token bucket of 500 (5 per retry, 10 per
// timeout), 1 token back per first-try success, a retried success refunding
// its cost. A status of 400 and up is the operation's error, which the
// retryer judges (500, 502, 503, 504 and an unmodelled 429 are retried);
// the body of a retry comes from GetBody (a body without GetBody is not
// retried). It sends no idempotency key and retries a POST as any other
// request, as the SDK does for operations it knows to be idempotent.
type AWSStandardTransport struct {
	Base    http.RoundTripper
	Retryer *awsretry.Standard
}

// awsStatusError is a status of 400 and up, as the SDK's response error
// carries it.
type awsStatusError struct{ code int }

func (e *awsStatusError) Error() string       { return fmt.Sprintf("status %d", e.code) }
func (e *awsStatusError) HTTPStatusCode() int { return e.code }

// RoundTrip implements http.RoundTripper.
func (t *AWSStandardTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	var releaseRetry func(error) error // the token of the retry in flight, nil for attempt 1
	for attempt := 1; ; attempt++ {
		r := req
		if attempt > 1 && req.Body != nil && req.Body != http.NoBody {
			body, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			c := *req
			c.Body = body
			r = &c
		}
		release := func(error) error { return nil }
		if attempt == 1 {
			// Without the SDK's retry metadata in ctx, this is attempt 1's
			// token: a success adds its reward to the bucket.
			if r, err := t.Retryer.GetAttemptToken(ctx); err == nil {
				release = r
			}
		}
		resp, err := t.Base.RoundTrip(r)
		opErr := err
		if err == nil && resp.StatusCode >= 400 {
			opErr = &awsStatusError{code: resp.StatusCode}
		}
		_ = release(opErr)
		if releaseRetry != nil {
			_ = releaseRetry(opErr)
		}
		if opErr == nil || attempt >= t.Retryer.MaxAttempts() || !t.Retryer.IsErrorRetryable(opErr) ||
			(req.Body != nil && req.Body != http.NoBody && req.GetBody == nil) {
			return resp, err
		}
		rel, terr := t.Retryer.GetRetryToken(ctx, opErr)
		if terr != nil {
			return resp, err // the retry quota is spent
		}
		releaseRetry = rel
		delay, derr := t.Retryer.RetryDelay(attempt, opErr)
		if derr != nil {
			return resp, err
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		timer := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}
