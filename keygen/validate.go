package keygen

import (
	"errors"
	"fmt"
)

// ErrInvalidKey is the sentinel matched (with errors.Is) by every error
// that [Validate] returns.
var ErrInvalidKey = errors.New("keygen: invalid idempotency key")

// Reasons reported in [InvalidKeyError.Reason].
const (
	// ReasonEmpty: the key has no bytes.
	ReasonEmpty = "empty"
	// ReasonTooLong: the key is longer than 255 bytes.
	ReasonTooLong = "too long"
	// ReasonInvalidChar: the key has a byte outside visible ASCII and the
	// space, 0x20..0x7E (a control character such as a tab or a newline,
	// DEL, or a non-ASCII byte).
	ReasonInvalidChar = "invalid character"
	// ReasonOuterSpace: the key begins or ends with a space. ParseHeader
	// trims the spaces around a bare header value, so such a key could not
	// be sent bare and read back.
	ReasonOuterSpace = "leading or trailing space"
	// ReasonList: the key header was sent on more than one field line (see
	// ParseHeader).
	ReasonList = "list"
	// ReasonMalformedString: a header value that starts and ends with a
	// double quote is not a valid RFC 9651 sf-string (a bad escape, an
	// unescaped '"' inside, or a byte outside 0x20..0x7E).
	ReasonMalformedString = "malformed string"
)

// InvalidKeyError describes why a key was rejected, without its bytes: an
// idempotency key is a credential-like value that logs must not carry. It
// matches [ErrInvalidKey] with errors.Is.
type InvalidKeyError struct {
	// Digest is the rejected value's [Digest], to match it with the
	// client's and the server's records without the key itself.
	Digest string
	// Reason is one of ReasonEmpty, ReasonTooLong, ReasonInvalidChar,
	// ReasonOuterSpace, or for header values ReasonList and
	// ReasonMalformedString.
	Reason string
	// Pos is the byte offset of the first invalid byte for
	// ReasonInvalidChar, of the offending space for ReasonOuterSpace, and -1
	// otherwise.
	Pos int
	// Char is the byte at Pos (0 when Pos is -1).
	Char byte
	// Len is the length of the rejected value in bytes.
	Len int
}

// Error describes the rejection by the key's digest, reason, length and
// offending byte, never its bytes, for example `keygen: invalid idempotency
// key (digest 9a3e51a4c1f0, 3 bytes): invalid character 0x01 at byte 1`.
func (e *InvalidKeyError) Error() string {
	msg := fmt.Sprintf("keygen: invalid idempotency key (digest %s, %d bytes): ", e.Digest, e.Len)
	switch e.Reason {
	case ReasonTooLong:
		return msg + fmt.Sprintf("too long (max %d)", maxLen)
	case ReasonInvalidChar:
		return msg + fmt.Sprintf("invalid character 0x%02X at byte %d "+
			"(want visible ASCII or a space, 0x20..0x7E)", e.Char, e.Pos)
	case ReasonOuterSpace:
		return msg + fmt.Sprintf("%s at byte %d", e.Reason, e.Pos)
	default:
		return msg + e.Reason
	}
}

// Is reports whether target is [ErrInvalidKey].
func (e *InvalidKeyError) Is(target error) bool { return target == ErrInvalidKey }

// Validate checks key against the one rule every idempotency key must meet,
// the rule of the Transport, the middleware and docs/CONTRACT.md alike: 1 to
// 255 bytes, each one visible ASCII or a space (0x20..0x7E), and
// neither the first nor the last byte a space. So "order 42",
// "invoice,2024-7" and `a"b\c` are valid keys (stripe-go sends any such
// key); control characters (tabs and newlines included), DEL and non-ASCII
// bytes are not. A key is what [ParseHeader] returns after trimming the
// spaces around a header value, which is why a key cannot begin or end with
// one. It returns nil for a valid key and otherwise an *[InvalidKeyError]
// that matches [ErrInvalidKey]; the checks run in the order empty, too long,
// invalid character, outer space. Safe for concurrent use.
func Validate(key string) error {
	if key == "" {
		return newInvalid(key, ReasonEmpty, -1)
	}
	if len(key) > maxLen {
		return newInvalid(key, ReasonTooLong, -1)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c > 0x7E {
			return newInvalid(key, ReasonInvalidChar, i)
		}
	}
	if key[0] == ' ' {
		return newInvalid(key, ReasonOuterSpace, 0)
	}
	if key[len(key)-1] == ' ' {
		return newInvalid(key, ReasonOuterSpace, len(key)-1)
	}
	return nil
}

func newInvalid(key, reason string, pos int) *InvalidKeyError {
	e := &InvalidKeyError{Digest: Digest(key), Reason: reason, Pos: pos, Len: len(key)}
	if pos >= 0 {
		e.Char = key[pos]
	}
	return e
}
