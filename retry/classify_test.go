package retry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var now = time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)

// allow500 is the rule that opts in to retrying 500.
var allow500 = []Rule{Status(Allow, 500)}

func resp(code int, header ...string) *http.Response {
	h := http.Header{}
	for i := 0; i+1 < len(header); i += 2 {
		h.Set(header[i], header[i+1])
	}
	return &http.Response{StatusCode: code, Header: h}
}

func TestClassifyStatuses(t *testing.T) {
	date := now.Add(30 * time.Second).Format(http.TimeFormat)
	tests := []struct {
		name   string
		rules  []Rule
		resp   *http.Response
		code   string // ProblemCode
		idem   Decision
		unsafe Decision // same input with Idempotent=false
	}{
		{"200", nil, resp(200), "", Decision{Class: ClassOK}, Decision{Class: ClassOK}},
		{"204", nil, resp(204), "", Decision{Class: ClassOK}, Decision{Class: ClassOK}},
		{"301", nil, resp(301), "", Decision{Class: ClassOK}, Decision{Class: ClassOK}},
		{"400", nil, resp(400), "", Decision{Class: "status_400"}, Decision{Class: "status_400"}},
		{"401", nil, resp(401), "", Decision{Class: "status_401"}, Decision{Class: "status_401"}},
		{"403", nil, resp(403), "", Decision{Class: "status_403"}, Decision{Class: "status_403"}},
		{"408", nil, resp(408), "", Decision{Class: "status_408"}, Decision{Class: "status_408"}},
		{"422 key reused", nil, resp(422), problemKeyReused, Decision{Class: ClassKeyReused}, Decision{Class: ClassKeyReused}},
		{"409 plain", nil, resp(409), "", Decision{Class: "status_409"}, Decision{Class: "status_409"}},
		{"409 other code", nil, resp(409), "something_else", Decision{Class: "status_409"}, Decision{Class: "status_409"}},
		{"409 in progress", nil, resp(409, "Retry-After", "1"), problemInProgress, Decision{Retry: true, Class: ClassInProgress, Throttle: true, RetryAfter: time.Second, HasRetryAfter: true}, Decision{Class: ClassInProgress, Throttle: true, RetryAfter: time.Second, HasRetryAfter: true}},
		{"409 plain ignores Retry-After", nil, resp(409, "Retry-After", "1"), "", Decision{Class: "status_409"}, Decision{Class: "status_409"}},
		{"409 key reused", nil, resp(409), problemKeyReused, Decision{Class: ClassKeyReused}, Decision{Class: ClassKeyReused}},
		{"422 in progress code is not retried", nil, resp(422), problemInProgress, Decision{Class: "status_422"}, Decision{Class: "status_422"}},
		{"429 no header", nil, resp(429), "", Decision{Retry: true, Class: "status_429", Throttle: true}, Decision{Class: "status_429", Throttle: true}},
		{"429 delta", nil, resp(429, "Retry-After", "3"), "", Decision{Retry: true, Class: "status_429", Throttle: true, RetryAfter: 3 * time.Second, HasRetryAfter: true}, Decision{Class: "status_429", Throttle: true, RetryAfter: 3 * time.Second, HasRetryAfter: true}},
		{"429 garbage header", nil, resp(429, "Retry-After", "soon"), "", Decision{Retry: true, Class: "status_429", Throttle: true}, Decision{Class: "status_429", Throttle: true}},
		{"500 default", nil, resp(500), "", Decision{Class: "status_500"}, Decision{Class: "status_500"}},
		{"500 opted in", allow500, resp(500), "", Decision{Retry: true, Class: "status_500"}, Decision{Class: "status_500"}},
		{"501", allow500, resp(501), "", Decision{Class: "status_501"}, Decision{Class: "status_501"}},
		{"502", nil, resp(502), "", Decision{Retry: true, Class: "status_502"}, Decision{Class: "status_502"}},
		{"502 ignores Retry-After", nil, resp(502, "Retry-After", "5"), "", Decision{Retry: true, Class: "status_502"}, Decision{Class: "status_502"}},
		{"503 no header", nil, resp(503), "", Decision{Retry: true, Class: "status_503"}, Decision{Class: "status_503"}},
		{"503 date", nil, resp(503, "Retry-After", date), "", Decision{Retry: true, Class: "status_503", Throttle: true, RetryAfter: 30 * time.Second, HasRetryAfter: true}, Decision{Class: "status_503", Throttle: true, RetryAfter: 30 * time.Second, HasRetryAfter: true}},
		{"503 invalid header is transient", nil, resp(503, "Retry-After", "-1"), "", Decision{Retry: true, Class: "status_503"}, Decision{Class: "status_503"}},
		{"504", nil, resp(504), "", Decision{Retry: true, Class: "status_504"}, Decision{Class: "status_504"}},
		{"505", nil, resp(505), "", Decision{Class: "status_505"}, Decision{Class: "status_505"}},
		{"nonsense status", nil, resp(0), "", Decision{Class: "status_invalid"}, Decision{Class: "status_invalid"}},
		{"nil header", nil, &http.Response{StatusCode: 429}, "", Decision{Retry: true, Class: "status_429", Throttle: true}, Decision{Class: "status_429", Throttle: true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := Input{Idempotent: true, Response: tc.resp, ProblemCode: tc.code}
			require.Equal(t, tc.idem, Classify(tc.rules, in, now))
			in.Idempotent = false
			require.Equal(t, tc.unsafe, Classify(tc.rules, in, now))
		})
	}
}

// fakeH2 has the text of net/http's unexported HTTP/2 errors, not their
// type.
type fakeH2 string

func (e fakeH2) Error() string { return string(e) }

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "net/http: timeout awaiting response headers" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func urlErr(err error) error { return &url.Error{Op: "Post", URL: "http://api.example/pay", Err: err} }

func opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}, Err: err}
}

func TestClassifyErrors(t *testing.T) {
	refusedStream := fakeH2("stream error: stream ID 3; REFUSED_STREAM")
	goAway := fakeH2(`http2: server sent GOAWAY and closed the connection; LastStreamID=1, ErrCode=NO_ERROR, debug=""`)
	tests := []struct {
		name     string
		err      error
		timedOut bool
		idem     Decision
		unsafe   Decision
	}{
		{"refused via OpError", urlErr(opErr("dial", os.NewSyscallError("connect", syscall.ECONNREFUSED))), false,
			Decision{Retry: true, Class: ClassConnRefused, NeverSent: true}, Decision{Retry: true, Class: ClassConnRefused, NeverSent: true}},
		{"bare ECONNREFUSED", syscall.ECONNREFUSED, false,
			Decision{Retry: true, Class: ClassConnRefused, NeverSent: true}, Decision{Retry: true, Class: ClassConnRefused, NeverSent: true}},
		{"dial DNS failure", opErr("dial", &net.DNSError{Err: "no such host", Name: "x.invalid", IsNotFound: true}), false,
			Decision{Retry: true, Class: ClassDial, NeverSent: true}, Decision{Retry: true, Class: ClassDial, NeverSent: true}},
		{"dial timeout (Dialer.Timeout)", urlErr(opErr("dial", timeoutErr{})), false,
			Decision{Retry: true, Class: ClassDial, NeverSent: true}, Decision{Retry: true, Class: ClassDial, NeverSent: true}},
		{"dial error during attempt timeout", opErr("dial", os.NewSyscallError("connect", syscall.ECONNREFUSED)), true,
			Decision{Retry: true, Class: ClassTimeout, NeverSent: true}, Decision{Retry: true, Class: ClassTimeout, NeverSent: true}},
		{"reset on read", urlErr(opErr("read", os.NewSyscallError("read", syscall.ECONNRESET))), false,
			Decision{Retry: true, Class: ClassConnReset}, Decision{Class: ClassConnReset}},
		{"EOF", urlErr(io.EOF), false, Decision{Retry: true, Class: ClassEOF}, Decision{Class: ClassEOF}},
		{"unexpected EOF wrapped", fmt.Errorf("reading: %w", io.ErrUnexpectedEOF), false, Decision{Retry: true, Class: ClassEOF}, Decision{Class: ClassEOF}},
		{"attempt timeout", context.DeadlineExceeded, true, Decision{Retry: true, Class: ClassTimeout}, Decision{Class: ClassTimeout}},
		{"attempt timeout as cancel", context.Canceled, true, Decision{Retry: true, Class: ClassTimeout}, Decision{Class: ClassTimeout}},
		{"caller deadline", urlErr(context.DeadlineExceeded), false, Decision{Class: ClassCallerDeadline}, Decision{Class: ClassCallerDeadline}},
		{"caller deadline wrapped", fmt.Errorf("x: %w", context.DeadlineExceeded), false, Decision{Class: ClassCallerDeadline}, Decision{Class: ClassCallerDeadline}},
		{"caller cancel", urlErr(context.Canceled), false, Decision{Class: ClassCanceled}, Decision{Class: ClassCanceled}},
		{"caller cancel during dial", opErr("dial", context.Canceled), false, Decision{Class: ClassCanceled}, Decision{Class: ClassCanceled}},
		{"transport timeout", urlErr(timeoutErr{}), false, Decision{Retry: true, Class: ClassTimeout}, Decision{Class: ClassTimeout}},
		{"socket read deadline", opErr("read", os.ErrDeadlineExceeded), false, Decision{Retry: true, Class: ClassTimeout}, Decision{Class: ClassTimeout}},
		{"h2 refused stream", urlErr(refusedStream), false,
			Decision{Retry: true, Class: ClassH2RefusedStream, NeverSent: true}, Decision{Retry: true, Class: ClassH2RefusedStream, NeverSent: true}},
		{"h2 cannot retry refused stream", fmt.Errorf("http2: Transport: cannot retry err [%w] after Request.Body was written; define Request.GetBody to avoid this error", refusedStream), false,
			Decision{Retry: true, Class: ClassH2RefusedStream, NeverSent: true}, Decision{Retry: true, Class: ClassH2RefusedStream, NeverSent: true}},
		// A GOAWAY is recognised by its type (TestClassifyRealGoAway), never
		// by its text, which an HTTP/1 status line can spell too.
		{"GOAWAY's text is no GOAWAY", urlErr(goAway), false, Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"nor is an HTTP/1 status line reading GOAWAY", fmt.Errorf("net/http: HTTP/1.x transport connection broken: %w", errors.New(`malformed HTTP status code "GOAWAY"`)), false,
			Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"an HTTP/1 status line cannot fake a refused stream", fmt.Errorf("net/http: HTTP/1.x transport connection broken: %w", errors.New(`malformed HTTP status code "REFUSED_STREAM"`)), false,
			Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"nor one that spells the whole stream error", errors.New(`malformed HTTP status code "stream error: stream ID 1; REFUSED_STREAM"`), false,
			Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"URL text cannot fake a refused stream", &url.Error{Op: "Post", URL: "http://x/REFUSED_STREAM/GOAWAY", Err: errors.New("boom")}, false,
			Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"tls unknown authority", urlErr(&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}), false, Decision{Class: ClassTLS}, Decision{Class: ClassTLS}},
		{"tls hostname", urlErr(x509.HostnameError{Host: "x"}), false, Decision{Class: ClassTLS}, Decision{Class: ClassTLS}},
		{"tls invalid", x509.CertificateInvalidError{Reason: x509.Expired}, false, Decision{Class: ClassTLS}, Decision{Class: ClassTLS}},
		{"tls verification wins over reset text", fmt.Errorf("%w; %w", &tls.CertificateVerificationError{Err: errors.New("bad")}, syscall.ECONNRESET), false,
			Decision{Class: ClassTLS}, Decision{Class: ClassTLS}},
		{"unknown error", errors.New("boom"), false, Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
		{"a refused re-send after a closed connection", urlErr(&ResendError{MayHaveArrived: true}), false,
			Decision{Retry: true, Class: ClassResend}, Decision{Class: ClassResend}},
		{"a refused re-send of a request not processed", urlErr(&ResendError{}), false,
			Decision{Retry: true, Class: ClassResend, NeverSent: true}, Decision{Retry: true, Class: ClassResend, NeverSent: true}},
		{"a refused re-send in an attempt timeout", &ResendError{}, true,
			Decision{Retry: true, Class: ClassTimeout}, Decision{Class: ClassTimeout}},
		{"EPIPE is not allow-listed", urlErr(opErr("write", os.NewSyscallError("write", syscall.EPIPE))), false,
			Decision{Class: ClassNotRetryable}, Decision{Class: ClassNotRetryable}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := Input{Idempotent: true, Err: tc.err, AttemptTimedOut: tc.timedOut}
			require.Equal(t, tc.idem, Classify(nil, in, now))
			in.Idempotent = false
			require.Equal(t, tc.unsafe, Classify(allow500, in, now))
		})
	}
}

func TestClassifyErrTakesPrecedenceAndZeroInput(t *testing.T) {
	require.Equal(t, Decision{Class: ClassNotRetryable}, Classify(nil, Input{}, now))
	d := Classify(nil, Input{Idempotent: true, Err: io.EOF, Response: resp(200)}, now)
	require.Equal(t, Decision{Retry: true, Class: ClassEOF}, d)
}

func TestExhaustedError(t *testing.T) {
	cause := fmt.Errorf("dial: %w", syscall.ECONNREFUSED)
	e := &ExhaustedError{Attempts: 3, Reason: ReasonMaxAttempts, Err: cause}
	require.Equal(t, "saferetry: gave up after 3 attempts (max_attempts): dial: connection refused", e.Error())
	require.ErrorIs(t, e, ErrExhausted)
	require.ErrorIs(t, e, syscall.ECONNREFUSED)
	wrapped := fmt.Errorf("pay: %w", e)
	var got *ExhaustedError
	require.ErrorAs(t, wrapped, &got)
	require.Equal(t, ReasonMaxAttempts, got.Reason)
	require.ErrorIs(t, wrapped, syscall.ECONNREFUSED)

	one := &ExhaustedError{Attempts: 1, Reason: ReasonBodyNotRewindable}
	require.Equal(t, "saferetry: gave up after 1 attempt (body_not_rewindable)", one.Error())
	require.ErrorIs(t, one, ErrExhausted)
	require.Equal(t, []error{ErrExhausted}, one.Unwrap())
	require.Equal(t, "saferetry: gave up after 0 attempts", (&ExhaustedError{}).Error())

	for _, r := range []Reason{ReasonNotRetryable, ReasonCanceled, ReasonMaxAttempts,
		ReasonBodyNotRewindable, ReasonDeadline, ReasonRetryAfterTooLong, ReasonBudget, ReasonPrepare,
		ReasonRetriedBelow} {
		require.Regexp(t, `^[a-z]+(_[a-z]+)*$`, string(r), "a label is snake_case")
	}
	for _, c := range []Class{ClassOK, ClassConnRefused, ClassDial, ClassConnReset, ClassEOF, ClassTimeout,
		ClassH2RefusedStream, ClassH2GoAway, ClassTLS, ClassCanceled, ClassCallerDeadline, ClassInProgress,
		ClassKeyReused, ClassNotRetryable} {
		require.Regexp(t, `^[a-z0-9]+(_[a-z0-9]+)*$`, string(c), "a label is snake_case")
	}
}

// A ResendError says whether the base transport sent the request again or
// the Transport refused it, and why the server may not have processed it.
func TestAResendErrorSaysWhetherTheRequestWentAgain(t *testing.T) {
	for _, tc := range []struct {
		err  ResendError
		want string
	}{
		{ResendError{MayHaveArrived: true},
			"saferetry: connection closed before the answer; the base transport's re-send refused"},
		{ResendError{}, "saferetry: request not processed; the base transport's re-send refused"},
		{ResendError{MayHaveArrived: true, Resent: true},
			"saferetry: connection closed before the answer; the base transport sent it again, as the next attempt"},
		{ResendError{Resent: true},
			"saferetry: request not processed; the base transport sent it again, as the next attempt"},
	} {
		require.Equal(t, tc.want, tc.err.Error())
	}
}
