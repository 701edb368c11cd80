package budget

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Budget decides whether a retry may be sent. One Budget is shared by every
// logical request to one host (see [Registry]); implementations must be safe
// for concurrent use, must not start goroutines, and take the current time as
// a parameter so that tests and simulations control it. No method returns an
// error or panics: a Budget that cannot grant a retry denies it.
//
// The client calls, per logical request: OnRequest once before attempt 1;
// AcquireRetry before every retry (never before attempt 1); Refund when a
// retry it granted is never sent; OnSuccess once when an attempt succeeds,
// with the cost of the retry that produced it (0 when attempt 1 succeeded).
// A failed logical request reports nothing more.
type Budget interface {
	// OnRequest records that a logical request starts (before attempt 1).
	OnRequest(now time.Time)
	// AcquireRetry asks for one retry. throttled is true when the server
	// asked the client to slow down (a 429, a 503 with Retry-After, an
	// in-progress 409: retry.Decision.Throttle), false after a transient
	// failure (another 5xx, a reset, a timeout). It returns the cost taken
	// and true, or 0 and false when denied; a denial takes nothing.
	AcquireRetry(now time.Time, throttled bool) (cost int, ok bool)
	// Refund gives back cost, what AcquireRetry returned for a retry that
	// was never sent (the caller canceled during the wait, the deadline
	// passed, or the attempt could not be prepared). It never raises the
	// budget above what it held before that grant could have been taken.
	Refund(now time.Time, cost int)
	// OnSuccess records that an attempt succeeded; retryCost is the cost that
	// AcquireRetry returned for the retry that produced it, 0 for a first try.
	OnSuccess(now time.Time, retryCost int)
	// Available reports what is left to spend right now, in the budget's own
	// unit (tokens, or retries), for logs. It never returns a negative number.
	Available(now time.Time) int
}

// ErrInvalidConfig is matched (errors.Is) by every error of the configs'
// Validate methods, whose message names the field, its value and the rule.
// Constructors never fail: a value Validate refuses is never replaced by
// its default, it has the meaning its field documents, always one that
// grants fewer retries than asked, never more. Call Validate first to
// reject such values instead.
var ErrInvalidConfig = errors.New("budget: invalid config")

// configError is the error of one invalid field.
func configError(field, value, reason string) error {
	return fmt.Errorf("%w: %s=%s: %s", ErrInvalidConfig, field, value, reason)
}

// Unlimited returns a Budget that grants every retry at cost 0 and records
// nothing. It is for tests and batch jobs whose only client is the caller;
// never use it in a fleet, where it removes the protection against retry
// storms. Available reports math.MaxInt. Safe for concurrent use (it is stateless).
func Unlimited() Budget { return unlimited{} }

type unlimited struct{}

func (unlimited) OnRequest(time.Time)                      {}
func (unlimited) AcquireRetry(time.Time, bool) (int, bool) { return 0, true }
func (unlimited) Refund(time.Time, int)                    {}
func (unlimited) OnSuccess(time.Time, int)                 {}
func (unlimited) Available(time.Time) int                  { return math.MaxInt }
