package deadline

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Header is the request header that carries the client's remaining time to
// the server: whole milliseconds as a non-negative decimal integer, for
// example "Request-Deadline-Ms: 2500". The saferetry Transport sends it on
// every attempt of a request whose context has a deadline (and on every
// request, or never, when its WithDeadlineHeader option says so);
// [Middleware] applies it.
const Header = "Request-Deadline-Ms"

// MaxPropagated is the longest remaining time [Middleware] applies to a
// request context. Larger header values are clamped to it, so a client
// cannot pin server resources for longer by sending a huge value.
const MaxPropagated = 5 * time.Minute

// ErrInvalidHeader is the sentinel matched (with errors.Is) by every error
// that [Parse] and [FromHeader] return.
var ErrInvalidHeader = errors.New("deadline: invalid " + Header + " header")

// Reasons reported in [HeaderError.Reason].
const (
	ReasonEmpty    = "empty"
	ReasonNegative = "negative"
	ReasonSyntax   = "not a decimal integer"
	ReasonOverflow = "overflow"
	ReasonMultiple = "multiple values"
)

// maxMillis is the largest millisecond count that fits in a time.Duration.
const maxMillis = math.MaxInt64 / int64(time.Millisecond)

// HeaderError describes why a [Header] value was rejected. It matches
// [ErrInvalidHeader] with errors.Is. Value is for display only: Go-quoted and
// truncated to its first 32 bytes, so it is safe to log.
type HeaderError struct {
	Value  string // the rejected value, quoted and truncated
	Reason string // one of the Reason constants
}

// Error describes the rejected value, for example
// `deadline: invalid Request-Deadline-Ms header "-5": negative`.
func (e *HeaderError) Error() string {
	return fmt.Sprintf("deadline: invalid %s header %s: %s", Header, e.Value, e.Reason)
}

// Is reports whether target is [ErrInvalidHeader].
func (e *HeaderError) Is(target error) bool { return target == ErrInvalidHeader }

func headerError(v, reason string) error {
	shown := v
	if len(shown) > 32 {
		shown = shown[:32]
	}
	q := strconv.QuoteToASCII(shown)
	if len(v) > 32 {
		q += "..."
	}
	return &HeaderError{Value: q, Reason: reason}
}

// Format renders a remaining time as a [Header] value: whole milliseconds,
// rounded down, and "0" for zero or negative durations. Safe for concurrent
// use.
func Format(remaining time.Duration) string {
	if remaining <= 0 {
		return "0"
	}
	return strconv.FormatInt(int64(remaining/time.Millisecond), 10)
}

// Parse reads a [Header] value: ASCII digits only (leading zeros allowed),
// optionally surrounded by spaces or tabs, meaning that many milliseconds.
// It returns an error matching [ErrInvalidHeader] (an *[HeaderError]) for an
// empty value, a sign ("-5" is negative, "+5" is rejected), anything that is
// not a plain decimal integer ("1.5", "5ms", "1e3", "5, 6") and values that
// do not fit in a time.Duration. Safe for concurrent use.
func Parse(value string) (time.Duration, error) {
	v := strings.Trim(value, " \t")
	if v == "" {
		return 0, headerError(value, ReasonEmpty)
	}
	if v[0] == '-' {
		return 0, headerError(value, ReasonNegative)
	}
	var n int64
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, headerError(value, ReasonSyntax)
		}
		if n > (maxMillis-int64(c-'0'))/10 {
			return 0, headerError(value, ReasonOverflow)
		}
		n = n*10 + int64(c-'0')
	}
	return time.Duration(n) * time.Millisecond, nil
}

// FromHeader reads the [Header] of h. It returns ok == false with a nil
// error when the header is absent, and an error matching [ErrInvalidHeader]
// when it is present more than once (reason [ReasonMultiple]) or its value
// does not [Parse]. Safe for concurrent use with other readers of h.
func FromHeader(h http.Header) (d time.Duration, ok bool, err error) {
	vals := h.Values(Header)
	switch len(vals) {
	case 0:
		return 0, false, nil
	case 1:
		d, err := Parse(vals[0])
		if err != nil {
			return 0, false, err
		}
		return d, true, nil
	default:
		return 0, false, headerError(strings.Join(vals, ", "), ReasonMultiple)
	}
}

// Propagate sets the [Header] of h to the time left at now before overall,
// rounded down to whole milliseconds and never negative (0 once the deadline
// has passed). A zero overall means there is no deadline to propagate:
// h is left untouched. A nil h is a no-op. Propagate replaces any earlier
// value, so call it on each attempt's own header map just before sending.
// It is not safe to call concurrently with other users of the same h.
func Propagate(h http.Header, now, overall time.Time) {
	if h == nil || overall.IsZero() {
		return
	}
	h.Set(Header, Format(Remaining(now, overall)))
}

// Middleware returns a handler that applies the client's propagated
// remaining time to the request context before calling next: when the
// request carries exactly one valid [Header] value, next runs with
// context.WithTimeout(r.Context(), min(value, MaxPropagated)). The timeout
// never extends a deadline the context already has (context.WithTimeout
// keeps the earlier one). A missing, repeated or invalid header is ignored
// and next runs with the request unchanged: the header is advisory, so a bad
// one must not fail the request. A value of 0 gives next a context that is
// already done. The context is cancelled when next returns. Safe for
// concurrent use.
func Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, ok, err := FromHeader(r.Header)
		if !ok || err != nil {
			next.ServeHTTP(w, r)
			return
		}
		if d > MaxPropagated {
			d = MaxPropagated
		}
		ctx, cancel := context.WithTimeout(r.Context(), d)
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}
