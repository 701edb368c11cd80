package keygen_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/keygen"
)

// ParseHeader is the one wire rule of the Transport and the middleware
// (moved here from the middleware's former copy, ParseKey).
func TestParseHeader(t *testing.T) {
	for _, tc := range []struct {
		vals   []string
		key    string
		reason string
	}{
		{nil, "", "empty"},
		{[]string{"abc"}, "abc", ""},
		{[]string{`"abc"`}, "abc", ""},
		{[]string{"\t abc \t"}, "abc", ""},
		{[]string{`"a\"b"`}, `a"b`, ""},
		{[]string{`"a\\b"`}, `a\b`, ""},
		{[]string{`a\b`}, `a\b`, ""},
		{[]string{"a;b=c"}, "a;b=c", ""},
		// What stripe-go sends: inner spaces, commas, any visible ASCII,
		// bare.
		{[]string{"order 42"}, "order 42", ""},
		{[]string{"  order 42 \t"}, "order 42", ""},
		{[]string{"invoice,2024-7"}, "invoice,2024-7", ""},
		{[]string{"a, b"}, "a, b", ""},
		{[]string{`a"b`}, `a"b`, ""},
		{[]string{`"abc`}, `"abc`, ""},
		{[]string{`abc"`}, `abc"`, ""},
		{[]string{`"abc"x`}, `"abc"x`, ""},
		{[]string{`"`}, `"`, ""},
		{[]string{`"a,b"`}, "a,b", ""},
		{[]string{`" order 42"`}, "", "outer_space"},
		{[]string{""}, "", "empty"},
		{[]string{"  \t "}, "", "empty"},
		{[]string{`""`}, "", "empty"},
		{[]string{"a", "b"}, "", "list"},
		{[]string{"a", "a"}, "", "list"},
		{[]string{`"a","b"`}, "", "malformed_string"},
		{[]string{`"a\nb"`}, "", "malformed_string"},
		{[]string{`"\"`}, "", "malformed_string"},
		{[]string{"\"a\x01\""}, "", "malformed_string"},
		{[]string{"\"caf\u00e9\""}, "", "malformed_string"},
		{[]string{"a\tb"}, "", "invalid_char"},
		{[]string{"a\x01b"}, "", "invalid_char"},
		{[]string{"caf\u00e9"}, "", "invalid_char"},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), ""},
		{[]string{" " + strings.Repeat("k", 255) + " "}, strings.Repeat("k", 255), ""},
		{[]string{strings.Repeat("k", 256)}, "", "too_long"},
		{[]string{`"` + strings.Repeat("k", 256) + `"`}, "", "too_long"},
	} {
		key, err := keygen.ParseHeader(tc.vals)
		require.Equal(t, tc.key, key, "%q", tc.vals)
		if tc.reason == "" {
			require.NoError(t, err, "%q", tc.vals)
			continue
		}
		require.ErrorIs(t, err, keygen.ErrInvalidKey, "%q", tc.vals)
		var ike *keygen.InvalidKeyError
		require.True(t, errors.As(err, &ike), "%q", tc.vals)
		require.Equal(t, tc.reason, ike.Reason, "%q", tc.vals)
		require.Less(t, len(err.Error()), 200, "the message must not echo a long key")
	}
}

// FuzzParseHeader checks ParseHeader against the rule stated in its doc,
// written independently here: trim SP and HTAB; a value that starts and ends
// with '"' is an sf-string; anything else is the key as it is.
func FuzzParseHeader(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b\\c"`, `"abc`, `a,b`, `"a", "b"`, "", `""`, "caf\u00e9",
		` "x" `, `\`, `"\`, `"\"`, "order 42", "invoice,2024-7", `"`, " \t", "a\tb"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, err := keygen.ParseHeader([]string{v})
		if err != nil {
			var ike *keygen.InvalidKeyError
			if !errors.Is(err, keygen.ErrInvalidKey) || !errors.As(err, &ike) || key != "" {
				t.Fatalf("ParseHeader(%q) = %q, %v", v, key, err)
			}
			if len(err.Error()) > 300 {
				t.Fatalf("message too long: %d bytes", len(err.Error()))
			}
		}
		want, ok := referenceParse(v)
		if ok != (err == nil) || key != want {
			t.Fatalf("ParseHeader(%q) = %q, %v; the reference says %q, %v", v, key, err, want, ok)
		}
		if err != nil {
			return
		}
		if verr := keygen.Validate(key); verr != nil {
			t.Fatalf("ParseHeader(%q) accepted %q that Validate rejects: %v", v, key, verr)
		}
		// FormatHeader round-trips every accepted key.
		back, err := keygen.ParseHeader([]string{keygen.FormatHeader(key)})
		if err != nil || back != key {
			t.Fatalf("FormatHeader(%q) = %q parses back to %q, %v", key, keygen.FormatHeader(key), back, err)
		}
	})
}

// referenceParse is ParseHeader's rule for one field line, written
// plainly: the key, and whether the value is accepted.
func referenceParse(v string) (string, bool) {
	v = strings.Trim(v, " \t")
	if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
		var b []byte
		inner := v[1 : len(v)-1]
		for i := 0; i < len(inner); i++ {
			switch c := inner[i]; {
			case c == '\\' && i+1 < len(inner) && (inner[i+1] == '"' || inner[i+1] == '\\'):
				b = append(b, inner[i+1])
				i++
			case c == '\\' || c == '"' || c < 0x20 || c > 0x7E:
				return "", false
			default:
				b = append(b, c)
			}
		}
		v = string(b)
	}
	if len(v) < 1 || len(v) > 255 || v[0] == ' ' || v[len(v)-1] == ' ' {
		return "", false
	}
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7E {
			return "", false
		}
	}
	return v, true
}

// FuzzFormatHeader checks the round trip ParseHeader(FormatHeader(k)) == k
// for every valid key k, and that FormatHeader's output is a single,
// sendable header value (no control characters, no outer spaces).
func FuzzFormatHeader(f *testing.F) {
	for _, s := range []string{"k", "order 42", "invoice,2024-7", `a"b\c`, `"x"`, `"`, `\`, `"\"`, "a, b",
		`""`, strings.Repeat(`"`, 255), strings.Repeat("k", 255), " k", "k\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		if keygen.Validate(key) != nil {
			return
		}
		h := keygen.FormatHeader(key)
		for i := 0; i < len(h); i++ {
			if h[i] < 0x20 || h[i] > 0x7E {
				t.Fatalf("FormatHeader(%q) = %q has byte 0x%02X", key, h, h[i])
			}
		}
		if strings.Trim(h, " \t") != h {
			t.Fatalf("FormatHeader(%q) = %q has outer spaces", key, h)
		}
		back, err := keygen.ParseHeader([]string{h})
		if err != nil || back != key {
			t.Fatalf("ParseHeader(FormatHeader(%q)) = ParseHeader(%q) = %q, %v", key, h, back, err)
		}
	})
}

func TestFormatHeader(t *testing.T) {
	require.Equal(t, "abc-1", keygen.FormatHeader("abc-1"))
	require.Equal(t, `"a,b"`, keygen.FormatHeader("a,b"))
	require.Equal(t, `"a\"b\\c"`, keygen.FormatHeader(`a"b\c`))
	require.Equal(t, "order 42", keygen.FormatHeader("order 42"))
	require.Equal(t, `"\"x\""`, keygen.FormatHeader(`"x"`))
}

// Digest is the name under which the Transport, the middleware, the
// Completer and the Reaper log a key: the first 6 bytes of its SHA-256, in
// hex.
func TestDigest(t *testing.T) {
	require.Equal(t, "ca978112ca1b", keygen.Digest("a"))
}
