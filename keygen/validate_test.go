package keygen

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidate(t *testing.T) {
	cases := []struct {
		name   string
		key    string
		reason string
		pos    int
	}{
		{"255 ok", strings.Repeat("k", 255), "", 0},
		{"one char", "k", "", 0},
		{"all printable", "!~azAZ09-_.:/%{}", "", 0},
		{"uuid", "3f1e2a4b-5c6d-4e7f-8a9b-0c1d2e3f4a5b", "", 0},
		{"empty", "", reasonEmpty, -1},
		{"256 chars", strings.Repeat("k", 256), reasonTooLong, -1},
		{"huge with control chars", strings.Repeat("\x00", 1<<20), reasonTooLong, -1},
		{"inner space", "order 42", "", 0},
		{"comma", "invoice,2024-7", "", 0},
		{"quote and backslash", `a"b\c`, "", 0},
		{"every visible byte and a space", visibleASCII(), "", 0},
		{"leading space", " x", reasonOuterSpace, 0},
		{"trailing space", "x ", reasonOuterSpace, 1},
		{"only a space", " ", reasonOuterSpace, 0},
		{"tab", "a\tb", reasonInvalidChar, 1},
		{"control char", "ab\x01", reasonInvalidChar, 2},
		{"newline", "a\r\nInjected: 1", reasonInvalidChar, 1},
		{"DEL", "a\x7f", reasonInvalidChar, 1},
		{"non-ASCII", "caf\u00e9", reasonInvalidChar, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := Validate(c.key)
			if c.reason == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidKey)
			var ike *InvalidKeyError
			require.True(t, errors.As(err, &ike))
			require.Equal(t, c.reason, ike.Reason)
			require.Equal(t, c.pos, ike.Pos)
			require.Equal(t, len(c.key), ike.Len)
			if c.pos >= 0 {
				require.Equal(t, c.key[c.pos], ike.Char)
			}
			msg := err.Error()
			require.Contains(t, msg, c.reason)
			require.LessOrEqual(t, len(msg), 300, "the message must not echo a huge key")
			for i := 0; i < len(msg); i++ {
				require.True(t, msg[i] >= 0x20 && msg[i] < 0x7f, "non-printable byte %q in %q", msg[i], msg)
			}
		})
	}
}

// An error about a key names it by its digest, reason, length and offending
// byte, never by its bytes.
func TestInvalidKeyErrorMessages(t *testing.T) {
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest("a\x01b")+", 3 bytes): "+
		"invalid_char: invalid character 0x01 at byte 1 (want visible ASCII or a space, 0x20..0x7E)",
		Validate("a\x01b").Error())
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest("")+", 0 bytes): empty: no bytes",
		Validate("").Error())
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest("order 42 ")+", 9 bytes): "+
		"outer_space: a space first or last, at byte 8", Validate("order 42 ").Error())
	long := strings.Repeat("z", 300)
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest(long)+", 300 bytes): "+
		"too_long: longer than 255 bytes", Validate(long).Error())
	_, err := ParseHeader([]string{"a", "b"})
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest("a, b")+", 4 bytes): "+
		"list: the header came on more than one field line", err.Error())
	_, err = ParseHeader([]string{`"a\qb"`})
	require.Equal(t, "keygen: invalid idempotency key (digest "+Digest(`"a\qb"`)+", 6 bytes): "+
		"malformed_string: a quoted value that is not an RFC 9651 sf-string", err.Error())
	for _, r := range []string{reasonEmpty, reasonTooLong, reasonInvalidChar, reasonOuterSpace, reasonList,
		reasonMalformedString} {
		require.Regexp(t, `^[a-z]+(_[a-z]+)*$`, r, "a label is snake_case")
	}
	for _, key := range []string{"secret-order-42\x01", "secret order 42 ", strings.Repeat("secret", 50)} {
		err := Validate(key)
		require.Error(t, err)
		require.NotContains(t, err.Error(), "secret", "the key's bytes never appear")
		var ike *InvalidKeyError
		require.ErrorAs(t, err, &ike)
		require.Equal(t, Digest(key), ike.Digest)
	}
	_, err = ParseHeader([]string{"secret-1", "secret-2"})
	require.NotContains(t, err.Error(), "secret")
	_, err = ParseHeader([]string{`"secret\q"`})
	require.NotContains(t, err.Error(), "secret")
	require.False(t, errors.Is(Validate(""), errors.New("keygen: invalid idempotency key")))
}

// visibleASCII returns every byte 0x21..0x7E with a space in the middle.
func visibleASCII() string {
	var b []byte
	for c := byte(0x21); c <= 0x7E; c++ {
		b = append(b, c)
		if c == 'M' {
			b = append(b, ' ')
		}
	}
	return string(b)
}
