package saferetry

import (
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// PrepareFunc prepares one attempt's request just before it is sent: after
// its body is rewound, after AttemptStart observers ran (r.Context() is the
// attempt's context) and after the deadline header is set. Use it to sign
// each attempt (AWS SigV4, an HMAC of a webhook) or to set a fresh
// short-lived token. attempt is 1 for the first attempt.
//
// r is the attempt's own copy: it may change r.Header (its own map and
// value slices) and r.URL (its own copy, for example a presigned query),
// never the caller's request. It must not read or replace r.Body; to hash
// the payload, read a fresh copy from r.GetBody, which is set whenever the
// body can be replayed (nil when it cannot, or when there is no body). It
// must not change the idempotency key header: adding, removing or changing
// it fails the attempt with ErrKeyChanged, because a signature computed over
// a key the Transport put back would be wrong. A returned error, or
// ErrKeyChanged, ends the loop before the attempt is sent (see PrepareError).
// It may be called concurrently for different requests. A panic in it is
// not recovered.
type PrepareFunc func(r *http.Request, attempt int) error

// ErrKeyChanged is wrapped by the *PrepareError of an attempt whose
// PrepareFunc added, removed or changed the idempotency key header.
var ErrKeyChanged = errors.New("saferetry: prepare changed the idempotency key header")

// PrepareError is the error of a PrepareFunc (or ErrKeyChanged), for the
// attempt it was preparing, which was not sent. RoundTrip returns it wrapped
// in a *retry.ExhaustedError whose Reason is retry.ReasonPrepare and whose
// Attempts counts the attempts sent before it; errors.As finds the
// PrepareError and errors.Is the function's own error through it. When an
// earlier attempt may have reached the server, its outcome is unknown (its
// response, if it had one, was drained and closed before the wait that
// preceded this attempt): send the request again later with the same key
// (ExhaustedError.Key).
type PrepareError struct {
	Attempt int   // the attempt that was being prepared, 1 for the first
	Err     error // the function's error, or ErrKeyChanged
}

// Error returns, for example, "saferetry: preparing attempt 2: token expired".
func (e *PrepareError) Error() string {
	return "saferetry: preparing attempt " + strconv.Itoa(e.Attempt) + ": " + e.Err.Error()
}

// Unwrap returns the function's error.
func (e *PrepareError) Unwrap() error { return e.Err }

// prepare runs the Transport's PrepareFuncs in order on the attempt's copy r,
// then checks that the key header (name, in any spelling) is what it was in
// before.
func prepare(fns []PrepareFunc, r *http.Request, attempt int, before http.Header, name string) error {
	for _, f := range fns {
		if err := f(r, attempt); err != nil {
			return &PrepareError{Attempt: attempt, Err: err}
		}
	}
	if !sameField(before, r.Header, name) {
		return &PrepareError{Attempt: attempt, Err: ErrKeyChanged}
	}
	return nil
}

// sameField reports whether a and b hold the same values for the field name,
// under every spelling of it.
func sameField(a, b http.Header, name string) bool {
	n := 0
	for k, v := range a {
		if strings.EqualFold(k, name) {
			if !slices.Equal(v, b[k]) {
				return false
			}
			n++
		}
	}
	for k := range b {
		if strings.EqualFold(k, name) {
			n--
		}
	}
	return n == 0
}
