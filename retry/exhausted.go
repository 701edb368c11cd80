package retry

import (
	"errors"
	"strconv"
)

// ErrExhausted is matched (errors.Is) by every [*ExhaustedError]: the
// Transport stopped retrying and had no response to return.
var ErrExhausted = errors.New("saferetry: retries exhausted")

// Reason is why a retry loop stopped: every value is snake_case, a label
// for logs and metrics as well as [ExhaustedError].Reason.
type Reason string

// The reasons a retry loop stops.
const (
	// ReasonNotRetryable: Classify refused the outcome.
	ReasonNotRetryable Reason = "not_retryable"
	// ReasonCanceled: the caller's context ended.
	ReasonCanceled Reason = "canceled"
	// ReasonMaxAttempts: every allowed attempt ran.
	ReasonMaxAttempts Reason = "max_attempts"
	// ReasonBodyNotRewindable: the request body cannot be sent again.
	ReasonBodyNotRewindable Reason = "body_not_rewindable"
	// ReasonDeadline: the wait before the next attempt would end after the
	// overall deadline (WithMaxElapsed, or the context's), or the deadline
	// passed before the next attempt could start.
	ReasonDeadline Reason = "deadline"
	// ReasonRetryAfterTooLong: the wait the server asks for (Retry-After,
	// or a spent RateLimit quota's window: Decision.RetryAfter) is longer
	// than the longest the Transport honours (WithMaxRetryAfter).
	ReasonRetryAfterTooLong Reason = "retry_after_too_long"
	// ReasonBudget: the retry budget refused the retry.
	ReasonBudget Reason = "budget_denied"
	// ReasonPrepare: the preparation of the next attempt failed.
	ReasonPrepare Reason = "prepare_failed"
	// ReasonRetriedBelow: the answer carries the mark "Retried-Below: true"
	// (docs/CONTRACT.md): a service further down the chain has already
	// retried this failure, so it is not retried again, whatever the rules.
	ReasonRetriedBelow Reason = "retried_below"
)

// ExhaustedError is returned when the retry loop ends without a response. It
// matches both [ErrExhausted] and its last cause with errors.Is and errors.As
// (through Unwrap() []error), so errors.Is(err, syscall.ECONNREFUSED) still
// works. The zero value is usable; an ExhaustedError is immutable once built
// and safe to share between goroutines.
type ExhaustedError struct {
	Attempts int    // attempts made, the first included
	Reason   Reason // why the loop stopped
	Err      error  // the last attempt's error; may be nil
	// Key is the idempotency key every attempt carried ("" for none). When
	// an attempt may have reached the server, the outcome is unknown: send
	// the request again later with this same key (never a new one) to learn
	// it or finish it. Error never prints it.
	Key string
}

// Error returns, for example,
// "saferetry: gave up after 3 attempts (max_attempts): dial tcp 127.0.0.1:1:
// connect: connection refused".
func (e *ExhaustedError) Error() string {
	msg := "saferetry: gave up after " + strconv.Itoa(e.Attempts) + " attempt"
	if e.Attempts != 1 {
		msg += "s"
	}
	if e.Reason != "" {
		msg += " (" + string(e.Reason) + ")"
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns ErrExhausted and, when set, the last cause.
func (e *ExhaustedError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrExhausted}
	}
	return []error{ErrExhausted, e.Err}
}

// ResendError is the error of an attempt that the base transport sent, or
// went to send, again by itself (ClassResend): net/http does so after the
// kept-alive connection the attempt rode closed before the answer, for an
// HTTP/2 stream the server refused or did not process, and when nothing of
// the request was written. The saferetry Transport refuses the re-send of
// an attempt with a body, so that its loop decides instead (nothing is
// written for the re-send), and counts that of an attempt without a body
// as the next attempt, whose send before it ends with this error.
type ResendError struct {
	// MayHaveArrived is true when the request is one net/http re-sends
	// after a kept-alive connection closed before the answer (a GET, HEAD,
	// OPTIONS or TRACE, or a request with an Idempotency-Key or
	// X-Idempotency-Key field): the server may have processed it, and it
	// is retried only when it may be repeated. False when net/http
	// re-sends it only where the server has not processed it: it is
	// retried whatever its method, as net/http itself would have.
	MayHaveArrived bool
	// Resent is true when the base transport did send it again, as the
	// next attempt; false when the Transport refused the re-send.
	Resent bool
}

func (e *ResendError) Error() string {
	why := "request not processed"
	if e.MayHaveArrived {
		why = "connection closed before the answer"
	}
	if e.Resent {
		return "saferetry: " + why + "; the base transport sent it again, as the next attempt"
	}
	return "saferetry: " + why + "; the base transport's re-send refused"
}
