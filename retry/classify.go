package retry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Problem codes (the "code" member of an application/problem+json body)
// that the saferetry idempotency middleware sends with its conflicts.
const (
	// problemInProgress marks a 409 for a key whose first request is still
	// running. It is the only 409 that is retried.
	problemInProgress = "idempotency_request_in_progress"
	// problemKeyReused marks a key reused with a different request
	// (422, or 409 when so configured). It is never retried.
	problemKeyReused = "idempotency_key_reused"
)

// Class labels the outcome of one attempt for logs, metrics and rules:
// one of the constants below, or "status_NNN" for a status they do not
// name (for example "status_503", "status_404"; "status_invalid" outside
// 100-999). Every value is snake_case.
type Class string

// The classes of [Decision].Class.
const (
	ClassOK              Class = "ok"                // a status below 400: nothing to retry
	ClassConnRefused     Class = "conn_refused"      // ECONNREFUSED while dialling (never sent)
	ClassDial            Class = "dial"              // any other dial error, e.g. DNS (never sent)
	ClassConnReset       Class = "conn_reset"        // ECONNRESET
	ClassEOF             Class = "eof"               // EOF or unexpected EOF before a response
	ClassTimeout         Class = "timeout"           // the attempt's time limit, or the transport's
	ClassH2RefusedStream Class = "h2_refused_stream" // HTTP/2 REFUSED_STREAM (never processed)
	ClassH2GoAway        Class = "h2_goaway"         // HTTP/2 GOAWAY
	ClassTLS             Class = "tls"               // certificate verification failed
	ClassCanceled        Class = "canceled"          // the caller canceled its context
	ClassCallerDeadline  Class = "caller_deadline"   // the caller's own context deadline passed
	ClassInProgress      Class = "in_progress"       // 409 idempotency_request_in_progress
	ClassKeyReused       Class = "key_reused"        // a conflict idempotency_key_reused
	ClassNotRetryable    Class = "not_retryable"     // an unrecognised error, or no outcome at all

	// ClassResend: the base transport sent the request again by itself, or
	// went to (a *ResendError): net/http does after a kept-alive connection
	// closed before the answer (retried when the request is idempotent),
	// and for an HTTP/2 stream the server refused or did not process, or
	// when nothing was written (retried whatever the method, as net/http
	// itself judges). The saferetry Transport refuses the re-send of a
	// request with a body, so that its loop decides, and counts that of a
	// bodyless one as the next attempt.
	ClassResend Class = "resend"
)

// Input describes the outcome of one attempt.
type Input struct {
	// Idempotent is true when the request may be repeated: an idempotent
	// method, an Idempotency-Key attached, or the caller declared it so.
	// When false, only failures where the request provably never reached
	// the server are retried.
	Idempotent bool
	// Response is the attempt's response; nil when Err is non-nil.
	// Classify reads only StatusCode and Header, never the body.
	Response *http.Response
	// Err is the error the attempt returned, if any. It takes precedence
	// over Response.
	Err error
	// AttemptTimedOut is true when the attempt's own time limit ended it
	// while the caller's context was still alive.
	AttemptTimedOut bool
	// ProblemCode is the "code" member of a problem+json body, when the
	// caller peeked one (for 409 conflicts); "" otherwise.
	ProblemCode string
	// Request is the caller's request, for [Rule]s (nil allowed; the
	// built-in allow-list ignores it). Read-only: never its body.
	Request *http.Request
	// Attempt is the attempt's number, 1 for the first (for [Rule]s).
	Attempt int
}

// Decision is the verdict of [Classify].
type Decision struct {
	// Retry reports whether the outcome may be retried; the attempt
	// limit, the deadline and the budget are the caller's to check.
	Retry bool
	// Class labels the outcome.
	Class Class
	// Throttle is true for 429, for a 503 that asks for a wait longer than
	// 0 (RetryAfter), and for the in-progress 409: the caller uses the
	// throttling backoff base and budget cost. A 503 asking for no wait
	// ("Retry-After: 0") is a transient failure, as one asking nothing is.
	Throttle bool
	// RetryAfter is how long the server asks the client to wait (429, 503
	// and the in-progress 409 only), valid when HasRetryAfter is true: its
	// Retry-After; or, on a 429 or 503 without a valid Retry-After, the
	// effective window of a quota its RateLimit fields say is spent (r=0;
	// see the package documentation of saferetry). It may be huge, the
	// caller caps it.
	RetryAfter time.Duration
	// HasRetryAfter reports whether the server asked for a wait: a valid
	// Retry-After, or RateLimit fields with a spent quota and its window.
	HasRetryAfter bool
	// NeverSent is true when the request provably never reached the server
	// (a dial error, an HTTP/2 refused stream); only then is a request that
	// is not idempotent retried.
	NeverSent bool
}

// Classify decides whether the attempt described by in may be retried, and
// labels it. now turns an HTTP-date Retry-After into a duration. The
// allow-list is in the package documentation.
//
// The built-in decision comes first, then rules may turn its Retry on or
// off (the first verdict other than [Keep] decides; nil rules are skipped);
// Class, Throttle, RetryAfter and NeverSent stay the built-in ones. Then the
// safety rules, which no Rule lifts: a success ([ClassOK]) and the caller's
// own cancellation or deadline ([ClassCanceled], [ClassCallerDeadline]) are never
// retried, and a request that is not idempotent is retried only when it
// provably never reached the server (NeverSent), never after a status or a
// timeout. The attempt limit, the deadline and the budget are the caller's
// to check after Classify.
//
// Classify is pure, never panics unless a Rule does (a zero Input yields
// [ClassNotRetryable]) and is safe for concurrent use when its rules are.
func Classify(rules []Rule, in Input, now time.Time) Decision {
	var d Decision
	switch {
	case in.Err != nil:
		d = classifyErr(in)
	case in.Response != nil:
		d = classifyStatus(in, now)
	default:
		d = Decision{Class: ClassNotRetryable}
	}
	if len(rules) > 0 {
		d = apply(rules, in, d)
	}
	return d
}

func classifyStatus(in Input, now time.Time) Decision {
	code := in.Response.StatusCode
	d := Decision{Class: statusClass(code)}
	if code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable ||
		(code == http.StatusConflict && in.ProblemCode == problemInProgress) {
		d.RetryAfter, d.HasRetryAfter = parseRetryAfter(in.Response.Header.Get("Retry-After"), now)
	}
	throttling := code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable
	if !d.HasRetryAfter && throttling {
		// Retry-After takes precedence; the RateLimit fields speak only
		// without a valid one.
		d.RetryAfter, d.HasRetryAfter = rateLimitWait(in.Response.Header)
	}
	switch code {
	case http.StatusTooManyRequests:
		d.Throttle = true
		d.Retry = true
	case http.StatusServiceUnavailable:
		// A wait of 0 is no throttling: it must never cost more than no
		// header at all (the throttling backoff's base is the longer one).
		d.Throttle = d.HasRetryAfter && d.RetryAfter > 0
		d.Retry = true
	case http.StatusBadGateway, http.StatusGatewayTimeout:
		d.Retry = true
	case http.StatusConflict:
		switch in.ProblemCode {
		case problemInProgress:
			// The server asks us to wait for the first request to finish:
			// a throttle, not a failure (cheaper budget cost, throttle base).
			d.Class, d.Retry, d.Throttle = ClassInProgress, true, true
		case problemKeyReused:
			d.Class = ClassKeyReused
		}
	default:
		if in.ProblemCode == problemKeyReused {
			d.Class = ClassKeyReused
		}
	}
	// A status proves the request reached the server: never retry an unsafe one.
	d.Retry = d.Retry && in.Idempotent
	return d
}

func statusClass(code int) Class {
	switch {
	case code >= 100 && code < 400:
		return ClassOK
	case code >= 400 && code <= 999:
		return Class("status_" + strconv.Itoa(code))
	}
	return "status_invalid"
}

func classifyErr(in Input) Decision {
	err := in.Err
	neverSent := isDial(err)
	switch {
	case in.AttemptTimedOut:
		// Our own per-attempt timer fired; the caller's context is alive.
		return Decision{
			Class: ClassTimeout, NeverSent: neverSent, Retry: in.Idempotent || neverSent,
		}
	case isTLSVerification(err):
		return Decision{Class: ClassTLS}
	case errors.Is(err, context.Canceled):
		return Decision{Class: ClassCanceled}
	case neverSent:
		class := ClassDial
		if errors.Is(err, syscall.ECONNREFUSED) {
			class = ClassConnRefused
		}
		return Decision{Class: class, NeverSent: true, Retry: true}
	case isContextDeadline(err):
		return Decision{Class: ClassCallerDeadline}
	}
	var resent *ResendError
	if errors.As(err, &resent) {
		never := !resent.MayHaveArrived
		return Decision{Class: ClassResend, NeverSent: never, Retry: in.Idempotent || never}
	}
	switch {
	case inTree(err, isGoAway):
		// Checked before the refused stream: a GOAWAY's message carries
		// server-chosen debug data, and the conservative class must win.
		return Decision{Class: ClassH2GoAway, Retry: in.Idempotent}
	case inTree(err, isRefusedStream):
		return Decision{Class: ClassH2RefusedStream, NeverSent: true, Retry: true}
	case errors.Is(err, syscall.ECONNRESET):
		return Decision{Class: ClassConnReset, Retry: in.Idempotent}
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return Decision{Class: ClassEOF, Retry: in.Idempotent}
	case isTransportTimeout(err):
		return Decision{Class: ClassTimeout, Retry: in.Idempotent}
	}
	return Decision{Class: ClassNotRetryable}
}

// isGoAway reports whether e is the error an HTTP/2 transport returns when
// the server sent GOAWAY and closed the connection before answering a
// stream it had accepted (its ID at most the GOAWAY's last stream ID, so
// the request may have been processed): net/http's bundled
// http2GoAwayError or golang.org/x/net/http2's GoAwayError. They are
// recognised by their type, never by their text, which carries the
// server's debug data and which any server can put in an error (an HTTP/1
// status line reading "GOAWAY"). A stream above the last stream ID was not
// processed: net/http retries it on a new connection itself. The error it
// returns for the first stream of a new connection whose GOAWAY carries an
// error code, a plain error, is not retried, as net/http does not retry it.
func isGoAway(e error) bool {
	t := reflect.TypeOf(e)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.PkgPath() {
	case "net/http":
		return t.Name() == "http2GoAwayError"
	case "golang.org/x/net/http2":
		return t.Name() == "GoAwayError"
	}
	return false
}

// isRefusedStream reports whether e is an HTTP/2 stream error with code
// REFUSED_STREAM, as net/http's bundled HTTP/2 transport (and
// golang.org/x/net/http2) format it: its own message is "stream error:
// stream ID <n>; REFUSED_STREAM", optionally followed by "; <cause>". The
// message must have that form from its first byte: a refused stream means
// that the request was never processed, so even an unkeyed POST may be sent
// again, and text a server chose (an HTTP/1 status line echoed in a parse
// error, GOAWAY debug data) must never pass for it.
func isRefusedStream(e error) bool {
	rest, ok := strings.CutPrefix(e.Error(), "stream error: stream ID ")
	if !ok {
		return false
	}
	digits := 0
	for digits < len(rest) && rest[digits] >= '0' && rest[digits] <= '9' {
		digits++
	}
	if digits == 0 {
		return false
	}
	rest = rest[digits:]
	return rest == "; REFUSED_STREAM" || strings.HasPrefix(rest, "; REFUSED_STREAM; ")
}

// inTree reports whether match holds for err or any error in its tree
// (errors.Unwrap, joined errors included).
func inTree(err error, match func(error) bool) bool {
	if err == nil {
		return false
	}
	if match(err) {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return inTree(u.Unwrap(), match)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if inTree(e, match) {
				return true
			}
		}
	}
	return false
}

// isDial reports whether err comes from establishing the connection, so the
// request was never written: a *net.OpError with Op "dial", or ECONNREFUSED.
func isDial(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}

// isTLSVerification reports whether err is a certificate verification failure.
func isTLSVerification(err error) bool {
	var (
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
		verify   *tls.CertificateVerificationError
	)
	return errors.As(err, &unknown) || errors.As(err, &hostname) ||
		errors.As(err, &invalid) || errors.As(err, &verify)
}

// isTransportTimeout reports a timeout raised inside the transport (for
// example http.Transport's ResponseHeaderTimeout or a socket read deadline):
// a net.Error whose Timeout is true. Callers rule out context deadlines first.
func isTransportTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// isContextDeadline reports whether context.DeadlineExceeded itself
// (compared with ==, not errors.Is) is in err's tree. It separates a
// context's deadline from net's socket timeouts, which also answer
// errors.Is(err, context.DeadlineExceeded).
func isContextDeadline(err error) bool {
	return inTree(err, func(e error) bool { return e == context.DeadlineExceeded })
}
