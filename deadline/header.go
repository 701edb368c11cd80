package deadline

import (
	"context"
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

// maxPropagated is the longest remaining time Middleware applies: larger
// values are clamped to it, so a client cannot pin server resources for
// longer by sending a huge value.
const maxPropagated = 5 * time.Minute

// Middleware returns a handler that applies the client's remaining time to
// the request context before calling next: when the request carries exactly
// one valid [Header] value, next runs with context.WithTimeout(r.Context(),
// min(value, 5 min)). It never extends a deadline the context already has.
// A missing, repeated or invalid value (not ASCII digits only, surrounded by
// optional spaces or tabs; too large for a time.Duration) is ignored and
// next runs with the request unchanged: the header is advisory, so a bad one
// must not fail the request. A value of 0 gives next a context that is
// already done. The context is canceled when next returns. Safe for
// concurrent use.
func Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, ok := fromHeader(r.Header)
		if !ok {
			next.ServeHTTP(w, r)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), min(d, maxPropagated))
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// fromHeader reads the one Header value of h; ok is false when there is
// none, more than one, or an invalid one.
func fromHeader(h http.Header) (d time.Duration, ok bool) {
	vals := h.Values(Header)
	if len(vals) != 1 {
		return 0, false
	}
	return parse(vals[0])
}

// parse reads a Header value: ASCII digits only (leading zeros allowed),
// optionally surrounded by spaces or tabs, meaning that many milliseconds.
// It refuses an empty value, a sign, anything else that is not a plain
// decimal integer ("1.5", "5ms", "5, 6") and values too large for a
// time.Duration.
func parse(value string) (time.Duration, bool) {
	// In base 10, ParseUint takes digits only: no sign, no "_", no prefix.
	n, err := strconv.ParseUint(strings.Trim(value, " \t"), 10, 64)
	if err != nil || n > math.MaxInt64/uint64(time.Millisecond) {
		return 0, false // not digits, or strconv.ErrRange, or too many ms
	}
	return time.Duration(n) * time.Millisecond, true
}
