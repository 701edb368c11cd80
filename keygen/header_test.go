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
		{nil, "", keygen.ReasonEmpty},
		{[]string{"abc"}, "abc", ""},
		{[]string{`"abc"`}, "abc", ""},
		{[]string{"\t abc \t"}, "abc", ""},
		{[]string{`"a\"b"`}, `a"b`, ""},
		{[]string{`"a\\b"`}, `a\b`, ""},
		{[]string{`a\b`}, `a\b`, ""},
		{[]string{"a;b=c"}, "a;b=c", ""},
		{[]string{""}, "", keygen.ReasonEmpty},
		{[]string{`""`}, "", keygen.ReasonEmpty},
		{[]string{"a", "b"}, "", keygen.ReasonList},
		{[]string{"a,b"}, "", keygen.ReasonList},
		{[]string{`"a","b"`}, "", keygen.ReasonList},
		{[]string{`"a,b"`}, "a,b", ""},
		{[]string{`"abc`}, "", keygen.ReasonMalformedString},
		{[]string{`"abc"x`}, "", keygen.ReasonMalformedString},
		{[]string{`"a\nb"`}, "", keygen.ReasonMalformedString},
		{[]string{"\"a\x01\""}, "", keygen.ReasonMalformedString},
		{[]string{`a"b`}, "", keygen.ReasonQuote},
		{[]string{"a b"}, "", keygen.ReasonInvalidChar},
		{[]string{"caf\u00e9"}, "", keygen.ReasonInvalidChar},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), ""},
		{[]string{strings.Repeat("k", 256)}, "", keygen.ReasonTooLong},
		{[]string{`"` + strings.Repeat("k", 256) + `"`}, "", keygen.ReasonTooLong},
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

func FuzzParseHeader(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b\\c"`, `"abc`, `a,b`, `"a", "b"`, "", `""`, "caf\u00e9", ` "x" `, `\`, `"\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, err := keygen.ParseHeader([]string{v})
		if err != nil {
			if !errors.Is(err, keygen.ErrInvalidKey) || key != "" {
				t.Fatalf("ParseHeader(%q) = %q, %v", v, key, err)
			}
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

func TestFormatHeader(t *testing.T) {
	require.Equal(t, "abc-1", keygen.FormatHeader("abc-1"))
	require.Equal(t, `"a,b"`, keygen.FormatHeader("a,b"))
	require.Equal(t, `"a\"b\\c"`, keygen.FormatHeader(`a"b\c`))
}

// Digest is the name under which the Transport, the middleware, the
// Completer and the Reaper log a key: the first 6 bytes of its SHA-256, in
// hex.
func TestDigest(t *testing.T) {
	require.Equal(t, "ca978112ca1b", keygen.Digest("a"))
}
