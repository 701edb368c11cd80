package idempotency

import (
	"net/http"

	"github.com/saferetry/saferetry/keygen"
)

// DefaultKeyHeader is the request header that carries the idempotency key
// unless WithKeyHeader names another one.
const DefaultKeyHeader = "Idempotency-Key"

// Reasons reported in KeyError.Reason for syntax errors (the same values
// as keygen's); validation errors from keygen.Validate report keygen's
// reasons ("empty", "too long", "invalid character").
const (
	// ReasonList: the header appears on more than one field line, or its
	// value is a comma-separated list.
	ReasonList = keygen.ReasonList
	// ReasonMalformedString: a quoted value is not a valid RFC 9651
	// sf-string (unterminated, a bad escape, a byte outside 0x20..0x7E, or
	// anything after the closing quote).
	ReasonMalformedString = keygen.ReasonMalformedString
	// ReasonQuote: a bare value contains a double quote.
	ReasonQuote = keygen.ReasonQuote
)

// KeyError reports an idempotency key header that ParseKey rejected. It
// matches keygen.ErrInvalidKey with errors.Is, and Unwrap returns the
// *keygen.InvalidKeyError when the syntax was fine but keygen.Validate
// rejected the key. Its message never echoes a raw key longer than 40 bytes.
type KeyError struct {
	Header string // the header name
	Reason string // ReasonList, ReasonMalformedString, ReasonQuote or a keygen reason
	Err    error  // keygen.ErrInvalidKey or the *keygen.InvalidKeyError
}

// Error describes the rejection.
func (e *KeyError) Error() string {
	if e.Err != nil && e.Err != keygen.ErrInvalidKey {
		return "idempotency: " + e.Header + ": " + e.Err.Error()
	}
	return "idempotency: " + e.Header + ": invalid idempotency key: " + e.Reason
}

// Unwrap returns the underlying keygen error.
func (e *KeyError) Unwrap() error { return e.Err }

// Is reports whether target is keygen.ErrInvalidKey.
func (e *KeyError) Is(target error) bool { return target == keygen.ErrInvalidKey }

// ParseKey reads the idempotency key from h under name (canonicalised like
// http.Header.Get; "" means DefaultKeyHeader). present is false when the
// header is absent, and then err is nil. A present header must be a single
// field line holding either a bare value (every byte printable ASCII except
// '"' and ',') or an RFC 9651 sf-string ("..." with only \" and \\ escapes),
// optionally surrounded by spaces or tabs; the unquoted key must then pass
// keygen.Validate (1..255 bytes of printable ASCII, no spaces). Anything else
// (two field lines, a list, an empty value, a malformed string, non-ASCII
// bytes, more than 255 bytes) returns present = true and a *KeyError that
// matches keygen.ErrInvalidKey. The rule is keygen.ParseHeader's, which the
// client Transport applies before sending. Safe for concurrent use; never
// panics.
func ParseKey(h http.Header, name string) (key string, present bool, err error) {
	if name == "" {
		name = DefaultKeyHeader
	}
	vals := h.Values(name)
	if len(vals) == 0 {
		return "", false, nil
	}
	key, perr := keygen.ParseHeader(vals)
	if perr == nil {
		return key, true, nil
	}
	reason := "invalid"
	var cause error = keygen.ErrInvalidKey
	if ike, ok := perr.(*keygen.InvalidKeyError); ok {
		reason = ike.Reason
		switch reason {
		case keygen.ReasonEmpty, keygen.ReasonTooLong, keygen.ReasonInvalidChar:
			cause = ike
		}
	}
	return "", true, &KeyError{Header: http.CanonicalHeaderKey(name), Reason: reason, Err: cause}
}

// FormatKey returns key as a header value that ParseKey reads back; it is
// keygen.FormatHeader. It does not validate key.
func FormatKey(key string) string { return keygen.FormatHeader(key) }

// LogDigest returns the short digest under which the middleware, the
// Completer and the Reaper name keys, principals and downstream keys in
// their logs; it is keygen.Digest.
func LogDigest(s string) string { return keygen.Digest(s) }
