package deadline

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/internal/hop"
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

// Middleware returns a handler that reads what the calling saferetry
// Transport sent and puts a record of the request in its context before
// calling next (see the package documentation):
//
//   - the deadline: when the request carries exactly one valid [Header]
//     value, next runs with context.WithTimeout(ctx, min(value, 5 min)),
//     which never extends a deadline the context already has; a value of
//     any size above 5 minutes means 5 minutes. A value of 0 gives next a
//     context that is already done. A missing, repeated or invalid value
//     (not ASCII digits only, surrounded by optional spaces or tabs) is
//     ignored: the header is advisory, so a bad one must not fail the
//     request;
//   - the attempt number, which [Attempt] returns (0 when the request
//     carries none, or an invalid one);
//   - pushback: when a saferetry Transport noted in the record that a call
//     made for the request had its failure retried (the package
//     documentation lists when), a 5xx or 429 status that next writes gets
//     the response header "Retried-Below: true".
//
// The context is canceled when next returns. next's writer has an Unwrap
// method (for http.ResponseController) and the optional interfaces of w,
// picked among the combinations of net/http's own writers:
//
//   - w is an http.Hijacker and an http.CloseNotifier (HTTP/1): http.Flusher,
//     http.Hijacker, http.CloseNotifier, io.ReaderFrom, io.StringWriter;
//   - w is an http.Hijacker only (a wrapper without the deprecated
//     http.CloseNotifier): http.Flusher, http.Hijacker, io.ReaderFrom,
//     io.StringWriter;
//   - w is an http.CloseNotifier and an http.Pusher (HTTP/2): http.Flusher,
//     http.CloseNotifier, http.Pusher, io.StringWriter;
//   - any other w: http.Flusher, io.ReaderFrom, io.StringWriter, and
//     http.ResponseController reaches the rest of w through Unwrap.
//
// A request costs three allocations (the writer with the record, the
// context, the request's copy). Safe for concurrent use.
func Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw := &markWriter{ResponseWriter: w, rec: hop.Record{Attempt: hop.ParseAttempt(r.Header)}}
		ctx := hop.NewContext(r.Context(), &mw.rec)
		if d, ok := fromHeader(r.Header); ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, d)
			defer cancel()
		}
		next.ServeHTTP(wrap(w, mw), r.WithContext(ctx))
	})
}

// Attempt returns the number of the attempt that the request whose context
// is ctx (or an ancestor of ctx) is, as its caller sent it in the
// Request-Attempt header and [Middleware] read it: 1 for a first try, 2
// and up for retries. It returns 0 when that is unknown: no Middleware, or
// a request without a valid attempt header (a client other than saferetry,
// or one built with WithAttemptHeader(false)).
func Attempt(ctx context.Context) int {
	if rec := hop.FromContext(ctx); rec != nil {
		return rec.Attempt
	}
	return 0
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
// optionally surrounded by spaces or tabs, meaning that many milliseconds,
// clamped to maxPropagated however many digits it has (strconv.ErrRange
// included). It refuses an empty value, a sign and anything else that is
// not a plain decimal integer ("1.5", "5ms", "5, 6").
func parse(value string) (time.Duration, bool) {
	v := strings.Trim(value, " \t")
	if v == "" || strings.Trim(v, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseUint(v, 10, 64) // digits only: strconv.ErrRange at worst
	if errors.Is(err, strconv.ErrRange) || n > uint64(maxPropagated/time.Millisecond) {
		return maxPropagated, true
	}
	return time.Duration(n) * time.Millisecond, true
}
