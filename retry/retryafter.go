package retry

import (
	"math"
	"net/http"
	"strings"
	"time"
)

// maxDuration is the largest time.Duration, used to clamp huge hints.
const maxDuration = time.Duration(math.MaxInt64)

// maxDeltaSeconds is the largest delta-seconds value that fits in a Duration.
const maxDeltaSeconds = int64(maxDuration / time.Second)

// ParseRetryAfter parses a Retry-After header value (RFC 9110 section 10.2.3)
// relative to now. It accepts delta-seconds (a non-empty run of ASCII digits,
// surrounding spaces and tabs ignored) and an HTTP-date in any of the formats
// http.ParseTime accepts (IMF-fixdate, RFC 850, asctime).
//
// It returns ok=false and 0 for an empty value, a negative or signed number,
// a fraction, or anything else it cannot parse. A date in the past (or now)
// yields 0, true. A delta too large for a time.Duration (for example
// "99999999999999999999") is clamped to the largest time.Duration, true;
// callers are expected to cap the hint themselves. ParseRetryAfter never
// panics and is safe for concurrent use.
func ParseRetryAfter(value string, now time.Time) (d time.Duration, ok bool) {
	v := strings.Trim(value, " \t")
	if v == "" {
		return 0, false
	}
	if isDigits(v) {
		var secs int64
		for i := 0; i < len(v); i++ {
			if secs > (maxDeltaSeconds-int64(v[i]-'0'))/10 {
				return maxDuration, true
			}
			secs = secs*10 + int64(v[i]-'0')
		}
		return time.Duration(secs) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	if !t.After(now) {
		return 0, true
	}
	// t.Sub saturates at the largest Duration for far-future dates.
	return t.Sub(now), true
}

// isDigits reports whether s is a non-empty run of ASCII digits.
func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
