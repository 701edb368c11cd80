package retry

import (
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// parseRetryAfter parses a Retry-After header value (RFC 9110 section
// 10.2.3) relative to now: delta-seconds (ASCII digits only, surrounding
// spaces and tabs ignored) or an HTTP-date in any format http.ParseTime
// accepts. It returns 0, false for an empty value, a sign, a fraction or
// anything else it cannot parse; 0, true for a date in the past; and the
// largest time.Duration, true for a delta too large for one (callers cap
// the hint).
func parseRetryAfter(value string, now time.Time) (time.Duration, bool) {
	v := strings.Trim(value, " \t")
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' { // ParseUint accepts no sign; "0x" and "_" need base 0
		secs, err := strconv.ParseUint(v, 10, 64)
		switch {
		case errors.Is(err, strconv.ErrRange),
			err == nil && secs > math.MaxInt64/uint64(time.Second):
			return time.Duration(math.MaxInt64), true
		case err == nil:
			return time.Duration(secs) * time.Second, true
		}
		// Not all digits: an HTTP-date never starts with a digit either.
		return 0, false
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	if !t.After(now) {
		return 0, true
	}
	return t.Sub(now), true // Sub saturates for far-future dates
}
