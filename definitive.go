package saferetry

import (
	"net/http"

	"github.com/saferetry/saferetry/internal/monitor"
)

// Definitive reports whether the outcome of a request, the response and
// error of RoundTrip (or http.Client.Do), says what became of it. The
// outcome is unknown (false) for:
//
//   - every error: no answer, or one cut off, so the request may have run;
//   - 429, 502, 503 and 504: the answer of a gateway or of an overloaded
//     server, which may have forwarded or started the request, or not;
//   - a 409 that asks for a wait (Retry-After): the idempotency
//     middleware's in-progress conflict, another request with the key runs;
//   - a 202 Accepted that points to a monitor (Location or
//     Operation-Location): the request runs on (WithFollowAccepted follows
//     it);
//   - no outcome at all (a nil response and a nil error).
//
// Every other response is definitive: what it says happened, a 2xx, a 4xx,
// a 500 the server answered itself. A request whose outcome is unknown and
// that carried an idempotency key is resolved by asking (Transport.Lookup)
// or by sending it again later with the same key, never a new one; within
// the server's replay window that runs it at most once. Definitive reads
// the status and headers only, never the body, and is safe for concurrent
// use.
func Definitive(resp *http.Response, err error) bool {
	if err != nil || resp == nil {
		return false
	}
	switch resp.StatusCode {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable,
		http.StatusGatewayTimeout:
		return false
	case http.StatusConflict:
		return resp.Header.Get("Retry-After") == ""
	case http.StatusAccepted:
		return resp.Header.Get("Location") == "" &&
			resp.Header.Get(monitor.OperationLocation) == ""
	}
	return true
}
