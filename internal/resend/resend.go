// Package resend keeps a base transport from sending a request again by
// itself where that can be done without changing what the server sees, so
// that the saferetry Transport's loop decides the retry instead.
//
// net/http's Transport sends a request again, once and silently, when the
// kept-alive connection it rode closed before the answer and the request
// is replayable (Request.isReplayable: a GET, HEAD, OPTIONS or TRACE, or a
// request with an Idempotency-Key or X-Idempotency-Key field, that has no
// body or a GetBody); its HTTP/2 transport does so for a stream the server
// refused or did not process. It rewinds a body only through GetBody, so a
// request with a body carries one that refuses (GetBody): the re-send fails
// with Err before anything is written. A bodyless request has nothing to
// rewind: the Transport counts each of its sends instead (httptrace's
// GotConn), and a client that must send a bodyless keyed request once
// writes its key fields under other spellings (Respell), which leaves only
// a bodyless GET, HEAD, OPTIONS or TRACE re-sent over HTTP/1.1, and any
// bodyless request whose HTTP/2 stream the server did not process.
package resend

import (
	"errors"
	"io"
	"net/http"
	"strings"
)

// Err is returned by GetBody, and so by net/http's RoundTrip where it went
// to send the attempt again by itself. The Transport puts a
// *retry.ResendError in its place.
var Err = errors.New("saferetry: the base transport went to send the attempt again by itself")

// GetBody is the GetBody of every attempt that has a body: it refuses.
func GetBody() (io.ReadCloser, error) { return nil, Err }

// names are the fields that make net/http take a request for replayable.
var names = [...]string{"Idempotency-Key", "X-Idempotency-Key"}

// Replays reports whether net/http's Transport sends r again by itself,
// once, when the kept-alive connection it rode closed before the answer,
// had r no body or a GetBody (Request.isReplayable): its method is GET,
// HEAD, OPTIONS or TRACE, or its header holds a field named exactly
// Idempotency-Key or X-Idempotency-Key.
func Replays(r *http.Request) bool {
	if byMethod(r.Method) {
		return true
	}
	for _, n := range names {
		if _, ok := r.Header[n]; ok {
			return true
		}
	}
	return false
}

// byMethod reports whether net/http re-sends a request of method whatever
// its header: GET (or ""), HEAD, OPTIONS and TRACE.
func byMethod(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// Respell returns h with its Idempotency-Key and X-Idempotency-Key fields
// under their lower-case names, which net/http does not look up: copied
// first (by clone) unless own says that h is the caller's to change, and
// whether the result is. The value slices are never modified. Field
// names are case-insensitive (RFC 9110 section 5.1), and HTTP/2 sends
// every name in lower case: the server reads the same fields.
func Respell(h http.Header, own bool, clone func(http.Header) http.Header) (http.Header, bool) {
	for _, n := range names {
		v, ok := h[n]
		if !ok {
			continue
		}
		if !own {
			h, own = clone(h), true
		}
		delete(h, n)
		lower := strings.ToLower(n)
		h[lower] = append(h[lower][:len(h[lower]):len(h[lower])], v...)
	}
	return h, own
}
