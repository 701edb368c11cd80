package keygen

import (
	"errors"
	"fmt"
	"strings"
)

// ErrInvalidKey is the sentinel matched (with errors.Is) by every error
// that [Validate] returns.
var ErrInvalidKey = errors.New("keygen: invalid idempotency key")

// The values of [InvalidKeyError.Reason]: snake_case labels for logs and
// metrics.
const (
	reasonEmpty           = "empty"
	reasonTooLong         = "too_long"
	reasonInvalidChar     = "invalid_char"
	reasonOuterSpace      = "outer_space"
	reasonList            = "list"
	reasonMalformedString = "malformed_string"
)

// InvalidKeyError describes why a key was rejected, without its bytes: an
// idempotency key is a credential-like value that logs must not carry. It
// matches [ErrInvalidKey] with errors.Is.
type InvalidKeyError struct {
	// Digest is the rejected value's [Digest], to match it with the
	// client's and the server's records without the key itself.
	Digest string
	// Reason says why, a snake_case label for logs and metrics, one of:
	//   - "empty": the key has no bytes;
	//   - "too_long": the key is longer than 255 bytes;
	//   - "invalid_char": the key has a byte outside visible ASCII and the
	//     space, 0x20..0x7E (a control character such as a tab or a
	//     newline, DEL, or a non-ASCII byte);
	//   - "outer_space": the key begins or ends with a space (ParseHeader
	//     trims the spaces around a bare header value, so such a key could
	//     not be sent bare and read back);
	//   - from ParseHeader only, "list": the key header came on more than
	//     one field line; "malformed_string": a header value that starts
	//     and ends with a double quote is not a valid RFC 9651 sf-string
	//     (a bad escape, an unescaped '"' inside, or a byte outside
	//     0x20..0x7E).
	// Match a rejected key with errors.Is(err, ErrInvalidKey); Reason is
	// for the record.
	Reason string
	// Pos is the byte offset of the first invalid byte for "invalid_char",
	// of the offending space for "outer_space", and -1 otherwise.
	Pos int
	// Char is the byte at Pos (0 when Pos is -1).
	Char byte
	// Len is the length of the rejected value in bytes.
	Len int
}

// Error describes the rejection by the key's digest, length, reason and
// offending byte, never its bytes, for example `keygen: invalid idempotency
// key (digest 9a3e51a4c1f0, 3 bytes): invalid_char: invalid character 0x01
// at byte 1 (want visible ASCII or a space, 0x20..0x7E)`.
func (e *InvalidKeyError) Error() string {
	msg := fmt.Sprintf("keygen: invalid idempotency key (digest %s, %d bytes): %s: ",
		e.Digest, e.Len, e.Reason)
	switch e.Reason {
	case reasonEmpty:
		return msg + "no bytes"
	case reasonTooLong:
		return msg + fmt.Sprintf("longer than %d bytes", maxLen)
	case reasonInvalidChar:
		return msg + fmt.Sprintf("invalid character 0x%02X at byte %d "+
			"(want visible ASCII or a space, 0x20..0x7E)", e.Char, e.Pos)
	case reasonOuterSpace:
		return msg + fmt.Sprintf("a space first or last, at byte %d", e.Pos)
	case reasonList:
		return msg + "the header came on more than one field line"
	case reasonMalformedString:
		return msg + "a quoted value that is not an RFC 9651 sf-string"
	default:
		return strings.TrimSuffix(msg, ": ")
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
		return newInvalid(key, reasonEmpty, -1)
	}
	if len(key) > maxLen {
		return newInvalid(key, reasonTooLong, -1)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c > 0x7E {
			return newInvalid(key, reasonInvalidChar, i)
		}
	}
	if key[0] == ' ' {
		return newInvalid(key, reasonOuterSpace, 0)
	}
	if key[len(key)-1] == ' ' {
		return newInvalid(key, reasonOuterSpace, len(key)-1)
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
