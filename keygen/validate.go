package keygen

import (
	"errors"
	"fmt"
	"strconv"
)

// ErrInvalidKey is the sentinel matched (with errors.Is) by every error
// that [Validate] returns.
var ErrInvalidKey = errors.New("keygen: invalid idempotency key")

// Reasons reported in [InvalidKeyError.Reason].
const (
	// ReasonEmpty: the key has no bytes.
	ReasonEmpty = "empty"
	// ReasonTooLong: the key is longer than MaxLen bytes.
	ReasonTooLong = "too long"
	// ReasonInvalidChar: the key has a byte outside printable ASCII
	// 0x21..0x7E (a space, a control character, DEL or a non-ASCII byte).
	ReasonInvalidChar = "invalid character"
	// ReasonList: the key header was sent on more than one field line, or
	// its value is a comma-separated list (see ParseHeader).
	ReasonList = "list"
	// ReasonMalformedString: a quoted header value is not a valid RFC 9651
	// sf-string (unterminated, a bad escape, a byte outside 0x20..0x7E, or
	// anything after the closing quote).
	ReasonMalformedString = "malformed string"
	// ReasonQuote: a bare header value contains a double quote.
	ReasonQuote = "quote in bare value"
)

// displayLen is the number of key bytes kept in InvalidKeyError.Key.
const displayLen = 40

// InvalidKeyError describes why [Validate] rejected a key. It matches
// [ErrInvalidKey] with errors.Is. Key holds at most the first 40 bytes of
// the rejected value, quoted and escaped: a short key appears whole.
type InvalidKeyError struct {
	// Key is the rejected key for display only: at most its first 40 bytes,
	// Go-quoted with non-ASCII and control bytes escaped, followed by "..."
	// when it was truncated.
	Key string
	// Reason is one of ReasonEmpty, ReasonTooLong, ReasonInvalidChar, or
	// for header values ReasonList, ReasonMalformedString, ReasonQuote.
	Reason string
	// Pos is the byte offset of the first invalid byte for
	// ReasonInvalidChar, and -1 otherwise.
	Pos int
	// Char is the first invalid byte for ReasonInvalidChar, and 0 otherwise.
	Char byte
	// Len is the length of the rejected key in bytes.
	Len int
}

// Error describes the rejection without echoing the raw key, for example
// `keygen: invalid idempotency key "a\x01b": invalid character 0x01 at byte 1`.
func (e *InvalidKeyError) Error() string {
	switch e.Reason {
	case ReasonTooLong:
		return fmt.Sprintf("keygen: invalid idempotency key %s: too long (%d bytes, max %d)", e.Key, e.Len, MaxLen)
	case ReasonInvalidChar:
		return fmt.Sprintf("keygen: invalid idempotency key %s: invalid character 0x%02X at byte %d (want printable ASCII 0x21..0x7E)", e.Key, e.Char, e.Pos)
	default:
		return fmt.Sprintf("keygen: invalid idempotency key %s: %s", e.Key, e.Reason)
	}
}

// Is reports whether target is [ErrInvalidKey].
func (e *InvalidKeyError) Is(target error) bool { return target == ErrInvalidKey }

// Validate checks key against the rules every idempotency key must meet:
// 1 to [MaxLen] bytes, each one printable ASCII 0x21..0x7E (so no spaces,
// no control characters, no non-ASCII). It returns nil for a valid key and
// otherwise an *[InvalidKeyError] that matches [ErrInvalidKey]; the checks run
// in the order empty, too long, invalid character. Safe for concurrent use.
func Validate(key string) error {
	if key == "" {
		return newInvalid(key, ReasonEmpty, -1)
	}
	if len(key) > MaxLen {
		return newInvalid(key, ReasonTooLong, -1)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7E {
			return newInvalid(key, ReasonInvalidChar, i)
		}
	}
	return nil
}

func newInvalid(key, reason string, pos int) *InvalidKeyError {
	e := &InvalidKeyError{Key: display(key), Reason: reason, Pos: pos, Len: len(key)}
	if pos >= 0 {
		e.Char = key[pos]
	}
	return e
}

func display(key string) string {
	if len(key) <= displayLen {
		return strconv.QuoteToASCII(key)
	}
	return strconv.QuoteToASCII(key[:displayLen]) + "..."
}
