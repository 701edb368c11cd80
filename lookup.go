package saferetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/saferetry/saferetry/internal/monitor"
	"github.com/saferetry/saferetry/keygen"
)

// ErrNoMonitor is the error of a Lookup whose server has no status monitor
// at the URL given: it answered what no monitor answers (a 404 without the
// monitor's problem code, a 405, a 501, a success that is no replay). The
// outcome is still unknown: send the request again with the same key, which
// a server that de-duplicates by key answers with the stored response when
// it ran.
var ErrNoMonitor = errors.New("saferetry: the server has no status monitor there")

// LookupResult is what the status monitor said of a request (Lookup).
type LookupResult struct {
	// State is the request's: OperationAbsent (send it again with the same
	// key: it runs), OperationInProgress (ask again after RetryAfter; do
	// not send it again meanwhile) or OperationCompleted.
	State OperationState
	// Response is, for OperationCompleted, the stored response as a replay
	// of the request gives it (Idempotent-Replayed: true), or the
	// middleware's 409 idempotency_response_not_replayable when it was too
	// large to store; nil otherwise. Its body is the caller's to read and
	// close.
	Response *http.Response
	// RetryAfter is, for OperationInProgress, the wait the monitor asks for
	// before the next question (its Retry-After, 1 s without one).
	RetryAfter time.Duration
}

// Lookup asks the status monitor of the server that req went to (the
// idempotency middleware's Monitor, mounted at monitorURL, such as
// "https://api.example.com/operations/") what became of req, sent with the
// idempotency key key: when its outcome is unknown (Definitive is false),
// instead of sending it again blindly. It sends one GET to monitorURL, with
// req's headers (its credentials: the monitor answers the principal the
// request had) but its body's, the key in the key header (never in the
// URL) and "Idempotency-Lookup: <req's method> <req's request URI>", through
// the Transport, so that the lookup itself is retried, budgeted, bounded by
// ctx and the overall deadline, and logged as any GET.
//
// key is the key the request was sent with: for an error,
// retry.ExhaustedError.Key (errors.As); for a response, the key field of
// resp.Request, which Lookup reads under any spelling when given
// resp.Request as req and key "". "" takes it from req's key header.
//
// The answer is typed (LookupResult); a completed one's Response is the
// caller's to close. The lookup cannot check the request's body (its
// fingerprint): a completed answer is the response of whichever request
// used the key in that scope. Errors: keygen.ErrInvalidKey (a missing or
// invalid key) before any I/O; ErrNoMonitor when the server has no monitor
// there (fall back to sending the request again with the same key); any
// other error means the lookup's own outcome is unknown (Definitive: no
// answer, a 5xx, a 429) or the monitor refused it (a 401, a 400), and the
// request's outcome is still unknown. Lookup never sends req itself and
// never runs anything on the server; it is safe for concurrent use.
func (t *Transport) Lookup(ctx context.Context, monitorURL string, req *http.Request,
	key string) (LookupResult, error) {
	if key == "" {
		vals := keyValues(req.Header, t.keyName, t.cfg.keyHeader)
		k, err := keygen.ParseHeader(vals)
		if err != nil {
			return LookupResult{}, fmt.Errorf("saferetry: lookup: the request's key: %w", err)
		}
		key = k
	}
	if err := keygen.Validate(key); err != nil {
		return LookupResult{}, fmt.Errorf("saferetry: lookup: %w", err)
	}
	if req.URL == nil {
		return LookupResult{}, errors.New("saferetry: lookup: the request has no URL")
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	lr, err := http.NewRequestWithContext(ctx, http.MethodGet, monitorURL, nil)
	if err != nil {
		return LookupResult{}, fmt.Errorf("saferetry: lookup: %w", err)
	}
	lr.Header = pollHeader(req.Header, t.keyName)
	lr.Header.Set(t.keyName, keygen.FormatHeader(key))
	lr.Header.Set(monitor.LookupHeader, method+" "+req.URL.RequestURI())
	resp, err := t.RoundTrip(lr)
	if err != nil {
		return LookupResult{}, fmt.Errorf("saferetry: lookup: %w", err)
	}
	code := ""
	if s := resp.StatusCode; s == http.StatusNotFound || s == http.StatusConflict ||
		s == http.StatusBadRequest {
		code = boundedPeek(resp)
	}
	res := LookupResult{}
	switch monitor.Read(resp, code) {
	case monitor.Completed:
		return LookupResult{State: OperationCompleted, Response: resp}, nil
	case monitor.InProgress:
		res = LookupResult{State: OperationInProgress, RetryAfter: askedWait(resp.Header)}
	case monitor.Absent:
		res = LookupResult{State: OperationAbsent}
	}
	discardBody(resp.Body)
	switch {
	case res.State != "":
		return res, nil
	case !Definitive(resp, nil):
		return LookupResult{}, fmt.Errorf("saferetry: lookup: the monitor's answer is unknown "+
			"(%d): the request's outcome is still unknown", resp.StatusCode)
	case resp.StatusCode == http.StatusUnauthorized, resp.StatusCode == http.StatusForbidden,
		resp.StatusCode == http.StatusBadRequest && code != "":
		return LookupResult{}, fmt.Errorf("saferetry: lookup: the monitor refused it: %d %s",
			resp.StatusCode, code)
	}
	return LookupResult{}, fmt.Errorf("%w (%s answered %d)", ErrNoMonitor, redactURL(monitorURL),
		resp.StatusCode)
}

// boundedPeek reads the problem code of a handed-over response, at most
// maxProblemPeek bytes for at most maxPeekTime (the body is aborted after
// that, which ends the read).
func boundedPeek(resp *http.Response) string {
	stop := time.AfterFunc(maxPeekTime, abort(resp.Body))
	code := peekProblemCode(resp)
	if !stop.Stop() {
		return ""
	}
	return code
}

// discardBody drains (at most maxDrain bytes, for at most maxPeekTime) and
// closes a handed-over body.
func discardBody(body io.ReadCloser) {
	stop := time.AfterFunc(maxPeekTime, abort(body))
	_, _ = io.Copy(io.Discard, io.LimitReader(body, maxDrain))
	stop.Stop()
	body.Close()
}

// abort returns what ends a read of body in flight: the cancellation of
// its attempt's context for a body the Transport handed over, else its
// Close.
func abort(body io.ReadCloser) func() {
	if d, ok := body.(*deliveredBody); ok {
		return func() { d.cancel(nil) }
	}
	return func() { body.Close() }
}

// redactURL returns u without its user information and query, for an
// error's text.
func redactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "the monitor URL"
	}
	p.User, p.RawQuery, p.Fragment = nil, "", ""
	return p.String()
}
