package budget

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Kind says why a retry is wanted; it selects the retry's cost in a [TokenBucket].
// The zero value is [Transient], the more expensive kind, so an unset Kind never
// under-charges. Kind values are plain integers and safe to share.
type Kind int

const (
	// Transient is a retry after a transient failure: a 5xx without Retry-After,
	// a refused or reset connection, an EOF before a response, a per-attempt timeout.
	Transient Kind = iota
	// Throttle is a retry after throttling: a 429, or a 503 carrying Retry-After.
	// The server asked us to slow down and said when, so it costs less.
	Throttle
)

// String returns "transient", "throttle", or "Kind(n)" for any other value.
func (k Kind) String() string {
	switch k {
	case Transient:
		return "transient"
	case Throttle:
		return "throttle"
	default:
		return fmt.Sprintf("Kind(%d)", int(k))
	}
}

// Budget decides whether a retry may be sent. One Budget is shared by every
// logical request to one host (see [Registry]); implementations must be safe
// for concurrent use, must not start goroutines, and take the current time as
// a parameter so that tests and simulations control it. No method returns an
// error or panics: a Budget that cannot grant a retry denies it.
//
// The client calls, per logical request: OnRequest once before attempt 1;
// AcquireRetry before every retry (never before attempt 1); OnSuccess once
// when an attempt succeeds, with the cost of the retry that produced it (0 when
// attempt 1 succeeded). A failed logical request reports nothing more.
type Budget interface {
	// OnRequest records that a logical request starts (before attempt 1).
	OnRequest(now time.Time)
	// AcquireRetry asks for one retry of the given kind. It returns the cost
	// taken and true, or 0 and false when denied; a denial takes nothing.
	AcquireRetry(now time.Time, k Kind) (cost int, ok bool)
	// OnSuccess records that an attempt succeeded; retryCost is the cost that
	// AcquireRetry returned for the retry that produced it, 0 for a first try.
	OnSuccess(now time.Time, retryCost int)
	// Available reports what is left to spend right now, in the budget's own
	// unit (tokens, or retries), for logs. It never returns a negative number.
	Available(now time.Time) int
}

// ErrInvalidConfig is the sentinel matched (via errors.Is) by every
// [*ConfigError] returned by the configs' Validate methods.
var ErrInvalidConfig = errors.New("budget: invalid config")

// ConfigError reports one invalid field of a [TokenBucketConfig] or
// [RatioConfig]. errors.Is(err, ErrInvalidConfig) holds for it.
// Constructors never fail: they replace invalid values by defaults; call
// Validate first to reject them instead.
type ConfigError struct {
	Field  string // e.g. "TokenBucketConfig.Capacity"
	Value  string // the offending value, formatted
	Reason string // e.g. "must not be negative"
}

// Error returns e.g. `budget: invalid config: TokenBucketConfig.Capacity=-1: must not be negative`.
func (e *ConfigError) Error() string {
	return fmt.Sprintf("%v: %s=%s: %s", ErrInvalidConfig, e.Field, e.Value, e.Reason)
}

// Unwrap returns [ErrInvalidConfig].
func (e *ConfigError) Unwrap() error { return ErrInvalidConfig }

// Unlimited returns a Budget that grants every retry at cost 0 and records
// nothing. It is for tests and batch jobs whose only client is the caller;
// never use it in a fleet, where it removes the protection against retry
// storms. Available reports math.MaxInt. Safe for concurrent use (it is stateless).
func Unlimited() Budget { return unlimited{} }

type unlimited struct{}

func (unlimited) OnRequest(time.Time)                      {}
func (unlimited) AcquireRetry(time.Time, Kind) (int, bool) { return 0, true }
func (unlimited) OnSuccess(time.Time, int)                 {}
func (unlimited) Available(time.Time) int                  { return math.MaxInt }
