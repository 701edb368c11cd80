// Package hop is what one hop of a chain of services tells the next, shared
// by the saferetry Transport (the root package) and deadline.Middleware: the
// attempt number each attempt carries downstream, the mark "retried below:
// do not retry" a server puts on its failed answer, and the Record of a
// request, which the middleware puts in the request's context and in which
// the Transport notes that a call made for that request had its failure
// retried (decide.PushBack says when). The wire format is
// docs/CONTRACT.md's.
package hop

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
)

// The header names, in the style of deadline.Header.
const (
	// AttemptHeader carries an attempt's number, 1 for the first: a decimal
	// integer, for example "Request-Attempt: 2".
	AttemptHeader = "Request-Attempt"
	// MarkHeader, with the value "true", marks a 5xx or 429 answer whose
	// failure was already retried by a service below: the caller must not
	// retry it.
	MarkHeader = "Retried-Below"
)

// maxAttemptDigits bounds what ParseAttempt reads: a value with more
// digits (after trimming) is refused without being parsed.
const maxAttemptDigits = 10

// attemptValues are the header values of the first attempts, put as they
// are into every request's header map. The slices are never modified: the
// http.RoundTripper contract forbids a base transport to modify a request.
var attemptValues = [...][]string{{"1"}, {"2"}, {"3"}, {"4"}, {"5"}, {"6"}, {"7"}, {"8"}}

// AttemptValue returns the AttemptHeader value of attempt n (n >= 1).
func AttemptValue(n int) []string {
	if n >= 1 && n <= len(attemptValues) {
		return attemptValues[n-1]
	}
	return []string{strconv.Itoa(n)}
}

// ParseAttempt returns the attempt number h carries: exactly one
// AttemptHeader field line whose value, without the spaces and tabs around
// it, is 1 to 10 ASCII digits meaning 1 to 2147483647 (leading zeros
// allowed). It returns 0, "unknown", for anything else: no field, two
// fields, an empty value, a sign, 0, a value out of range.
func ParseAttempt(h http.Header) int {
	vals := h[AttemptHeader]
	if len(vals) != 1 {
		return 0
	}
	return parseAttempt(vals[0])
}

func parseAttempt(v string) int {
	v = strings.Trim(v, " \t")
	if len(v) > maxAttemptDigits {
		return 0
	}
	n, err := strconv.ParseUint(v, 10, 31) // digits only: no sign, no "_", no prefix
	if err != nil || n == 0 {
		return 0
	}
	return int(n)
}

// Failure reports whether status is one that the mark applies to: a 5xx
// or a 429. deadline.Middleware marks only those, and a client honours the
// mark only on those.
func Failure(status int) bool {
	return status >= 500 || status == http.StatusTooManyRequests
}

// Marked reports whether resp, nil for none, carries the mark: it is a
// Failure with exactly one MarkHeader field line, whose value is exactly
// "true". Anything else is no mark: another value or case ("TRUE"), a list
// ("true, true"), two field lines, the mark on any other status.
func Marked(resp *http.Response) bool {
	if resp == nil || !Failure(resp.StatusCode) {
		return false
	}
	vals := resp.Header[MarkHeader]
	return len(vals) == 1 && vals[0] == "true"
}

// Mark sets the mark on h.
func Mark(h http.Header) { h[MarkHeader] = []string{"true"} }

// Record is what deadline.Middleware knows about the request it serves: the
// attempt number the caller sent, and whether a call made for the request
// had its failure retried. It is safe for concurrent use: a handler may
// make several calls at once.
type Record struct {
	Attempt int // the caller's attempt number, 0 when unknown
	retried atomic.Bool
}

// NoteRetriedBelow records that a call made for the request had its
// failure retried, here or below (decide.PushBack): the request's own
// failure has been retried below.
func (r *Record) NoteRetriedBelow() { r.retried.Store(true) }

// RetriedBelow reports whether NoteRetriedBelow was called.
func (r *Record) RetriedBelow() bool { return r.retried.Load() }

type recordKey struct{}

// NewContext returns ctx carrying r.
func NewContext(ctx context.Context, r *Record) context.Context {
	return context.WithValue(ctx, recordKey{}, r)
}

// FromContext returns the Record ctx carries, nil when none.
func FromContext(ctx context.Context) *Record {
	r, _ := ctx.Value(recordKey{}).(*Record)
	return r
}
