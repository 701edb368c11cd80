// Package monitor is the wire of the idempotency middleware's status
// monitor, shared by the middleware (package idempotency), which answers on
// it, and the saferetry Transport, which follows and asks it: the header
// names and problem codes of docs/CONTRACT.md, and how an answer of the
// monitor reads.
package monitor

import (
	"net/http"
	"net/url"
)

// The header names.
const (
	// LookupHeader carries, on a lookup by key, the method and request
	// target of the request looked up: "POST /payments?x=1".
	LookupHeader = "Idempotency-Lookup"
	// OperationLocation carries, beside Location, the monitor URL of an
	// operation a 202 Accepted left running.
	OperationLocation = "Operation-Location"
	// ReplayedHeader is set to "true" on a stored response, replayed.
	ReplayedHeader = "Idempotent-Replayed"
)

// The problem codes of the monitor's answers that the client reads.
const (
	// CodeAbsent: no request with the key in the caller's scope.
	CodeAbsent = "idempotency_request_absent"
	// CodeNotReplayable: completed, but its response was not stored.
	CodeNotReplayable = "idempotency_response_not_replayable"
)

// State is what an answer of the monitor says of an operation.
type State int

const (
	Unknown    State = iota // not an answer about the operation
	Absent                  // 404 CodeAbsent
	InProgress              // 202 without the replay marker
	Completed               // a replay (the marker), or 409 CodeNotReplayable
)

// Read says what resp, an answer of the monitor whose problem code (for a
// problem+json body) is code, says of the operation.
func Read(resp *http.Response, code string) State {
	switch {
	case replayed(resp.Header):
		return Completed
	case resp.StatusCode == http.StatusAccepted:
		return InProgress
	case resp.StatusCode == http.StatusNotFound && code == CodeAbsent:
		return Absent
	case resp.StatusCode == http.StatusConflict && code == CodeNotReplayable:
		return Completed
	}
	return Unknown
}

// replayed reports whether h marks a replayed response: one
// Idempotent-Replayed field line, exactly "true".
func replayed(h http.Header) bool {
	v := h.Values(ReplayedHeader)
	return len(v) == 1 && v[0] == "true"
}

// Location returns the monitor URL an answer to a request for base points
// to (Operation-Location, else Location), resolved against base, and
// whether it has one on base's origin (scheme and host): the caller's
// credentials go to no other.
func Location(base *url.URL, h http.Header) (*url.URL, bool) {
	v := h.Get(OperationLocation)
	if v == "" {
		v = h.Get("Location")
	}
	if v == "" {
		return nil, false
	}
	ref, err := url.Parse(v)
	if err != nil {
		return nil, false
	}
	u := base.ResolveReference(ref)
	if u.Scheme != base.Scheme || u.Host != base.Host || u.User != nil {
		return nil, false
	}
	return u, true
}
