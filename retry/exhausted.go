package retry

import (
	"errors"
	"strconv"
)

// ErrExhausted is matched (errors.Is) by every [*ExhaustedError]: the
// Transport stopped retrying and had no response to return.
var ErrExhausted = errors.New("saferetry: retries exhausted")

// Reasons recorded in [ExhaustedError].Reason: why the retry loop stopped.
const (
	ReasonMaxAttempts       = "max attempts"        // every allowed attempt ran
	ReasonNotRetryable      = "not retryable"       // Classify refused the last outcome
	ReasonDeadline          = "deadline"            // the overall deadline passed or the next wait would cross it
	ReasonBudget            = "budget denied"       // the retry budget refused a token
	ReasonCanceled          = "canceled"            // the caller canceled its context
	ReasonBodyNotRewindable = "body not rewindable" // the body could not be replayed (no GetBody, above the buffer limit)
	ReasonPrepare           = "prepare failed"      // the user's preparation of the next attempt failed (saferetry.PrepareError)
)

// ExhaustedError is returned when the retry loop ends without a response. It
// matches both [ErrExhausted] and its last cause with errors.Is and errors.As
// (through Unwrap() []error), so errors.Is(err, syscall.ECONNREFUSED) still
// works. The zero value is usable; an ExhaustedError is immutable once built
// and safe to share between goroutines.
type ExhaustedError struct {
	Attempts int    // attempts that ran, including the first
	Reason   string // why the loop stopped: one of the Reason* constants
	Err      error  // the last attempt's error; may be nil
	// Key is the idempotency key every attempt carried ("" for none). When
	// an attempt may have reached the server, the outcome is unknown: send
	// the request again later with this same key (never a new one) to learn
	// it or finish it. Error never prints it.
	Key string
}

// Error returns, for example,
// "saferetry: gave up after 3 attempts (max attempts): dial tcp 127.0.0.1:1: connect: connection refused".
func (e *ExhaustedError) Error() string {
	msg := "saferetry: gave up after " + strconv.Itoa(e.Attempts) + " attempt"
	if e.Attempts != 1 {
		msg += "s"
	}
	if e.Reason != "" {
		msg += " (" + e.Reason + ")"
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
