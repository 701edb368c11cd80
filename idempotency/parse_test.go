package idempotency_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/keygen"
)

func TestParseKey(t *testing.T) {
	for _, tc := range []struct {
		vals    []string
		key     string
		present bool
		reason  string
	}{
		{nil, "", false, ""},
		{[]string{"abc"}, "abc", true, ""},
		{[]string{`"abc"`}, "abc", true, ""},
		{[]string{"\t abc \t"}, "abc", true, ""},
		{[]string{`"a\"b"`}, `a"b`, true, ""},
		{[]string{`"a\\b"`}, `a\b`, true, ""},
		{[]string{`a\b`}, `a\b`, true, ""},
		{[]string{"a;b=c"}, "a;b=c", true, ""},
		{[]string{""}, "", true, keygen.ReasonEmpty},
		{[]string{`""`}, "", true, keygen.ReasonEmpty},
		{[]string{"a", "b"}, "", true, idempotency.ReasonList},
		{[]string{"a,b"}, "", true, idempotency.ReasonList},
		{[]string{`"a","b"`}, "", true, idempotency.ReasonList},
		{[]string{`"a,b"`}, "a,b", true, ""},
		{[]string{`"abc`}, "", true, idempotency.ReasonMalformedString},
		{[]string{`"abc"x`}, "", true, idempotency.ReasonMalformedString},
		{[]string{`"a\nb"`}, "", true, idempotency.ReasonMalformedString},
		{[]string{"\"a\x01\""}, "", true, idempotency.ReasonMalformedString},
		{[]string{`a"b`}, "", true, idempotency.ReasonQuote},
		{[]string{"a b"}, "", true, keygen.ReasonInvalidChar},
		{[]string{"caf\u00e9"}, "", true, keygen.ReasonInvalidChar},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), true, ""},
		{[]string{strings.Repeat("k", 256)}, "", true, keygen.ReasonTooLong},
		{[]string{`"` + strings.Repeat("k", 256) + `"`}, "", true, keygen.ReasonTooLong},
	} {
		h := http.Header{}
		for _, v := range tc.vals {
			h.Add("Idempotency-Key", v)
		}
		key, present, err := idempotency.ParseKey(h, "")
		require.Equal(t, tc.present, present, "%q", tc.vals)
		require.Equal(t, tc.key, key, "%q", tc.vals)
		if tc.reason == "" {
			require.NoError(t, err, "%q", tc.vals)
			continue
		}
		require.ErrorIs(t, err, keygen.ErrInvalidKey, "%q", tc.vals)
		var ke *idempotency.KeyError
		require.True(t, errors.As(err, &ke), "%q", tc.vals)
		require.Equal(t, tc.reason, ke.Reason, "%q", tc.vals)
		require.Equal(t, "Idempotency-Key", ke.Header)
		require.Less(t, len(err.Error()), 200, "the message must not echo a long key")
	}
	// A custom header name, canonicalised.
	key, present, err := idempotency.ParseKey(http.Header{"X-Request-Key": {"k"}}, "x-request-key")
	require.NoError(t, err)
	require.True(t, present)
	require.Equal(t, "k", key)
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b\\c"`, `"abc`, `a,b`, `"a", "b"`, "", `""`, "caf\u00e9", ` "x" `, `\`, `"\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, present, err := idempotency.ParseKey(http.Header{"Idempotency-Key": {v}}, "")
		if !present {
			t.Fatal("present = false for a present header")
		}
		if err != nil {
			if !errors.Is(err, keygen.ErrInvalidKey) || key != "" {
				t.Fatalf("ParseKey(%q) = %q, %v", v, key, err)
			}
			return
		}
		if verr := keygen.Validate(key); verr != nil {
			t.Fatalf("ParseKey(%q) accepted %q that keygen rejects: %v", v, key, verr)
		}
		// FormatKey round-trips every accepted key.
		back, _, err := idempotency.ParseKey(http.Header{"Idempotency-Key": {idempotency.FormatKey(key)}}, "")
		if err != nil || back != key {
			t.Fatalf("FormatKey(%q) = %q parses back to %q, %v", key, idempotency.FormatKey(key), back, err)
		}
	})
}

func TestFormatKey(t *testing.T) {
	require.Equal(t, "abc-1", idempotency.FormatKey("abc-1"))
	require.Equal(t, `"a,b"`, idempotency.FormatKey("a,b"))
	require.Equal(t, `"a\"b\\c"`, idempotency.FormatKey(`a"b\c`))
}

func TestCanonicalJSON(t *testing.T) {
	for in, want := range map[string]string{
		`{"b":1,"a":[true,null,{"d":"x","c":1.50}]}`: `{"a":[true,null,{"c":1.50,"d":"x"}],"b":1}`,
		" \n{ \"a\" : 1e3 }\t":                       `{"a":1e3}`,
		`"<&>"`:                                      `"<&>"`,
		`{"a":1,"a":2}`:                              `{"a":2}`,
		`-0`:                                         `-0`,
	} {
		got, err := idempotency.CanonicalJSON([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, want, string(got), in)
	}
	for _, bad := range []string{``, `{`, `{"a":1} {}`, `{"a":1}x`, `[1,]`, `nul`} {
		_, err := idempotency.CanonicalJSON([]byte(bad))
		require.ErrorIs(t, err, idempotency.ErrNotJSON, bad)
	}
}

func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":2}`, `[1, 2.0, "x", null]`, `{"a":{"c":[],"b":{}}}`, `"\u00e9\ud800"`, `1e400`, `{`, ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		c, err := idempotency.CanonicalJSON([]byte(in))
		if err != nil {
			if json.Valid([]byte(in)) {
				t.Fatalf("valid JSON %q rejected: %v", in, err)
			}
			return
		}
		if !json.Valid(c) {
			t.Fatalf("canonical form %q of %q is not JSON", c, in)
		}
		again, err := idempotency.CanonicalJSON(c)
		if err != nil || !bytes.Equal(again, c) {
			t.Fatalf("not idempotent: %q -> %q -> %q (%v)", in, c, again, err)
		}
		// Reordering the keys of a top-level object does not change it.
		var m map[string]json.RawMessage
		if json.Unmarshal(c, &m) == nil && len(m) > 1 {
			var buf bytes.Buffer
			buf.WriteByte('{')
			keys := make([]string, 0, len(m))
			for k := range m {
				keys = append(keys, k)
			}
			for i := len(keys) - 1; i >= 0; i-- { // reverse of sorted
				kb, _ := json.Marshal(keys[i])
				buf.Write(kb)
				buf.WriteString(" : ")
				buf.Write(m[keys[i]])
				if i > 0 {
					buf.WriteString(" ,\n")
				}
			}
			buf.WriteByte('}')
			r, err := idempotency.CanonicalJSON(buf.Bytes())
			if err != nil || !bytes.Equal(r, c) {
				t.Fatalf("reordered %q canonicalises to %q, want %q (%v)", buf.Bytes(), r, c, err)
			}
		}
	})
}

func TestFingerprint(t *testing.T) {
	fp := func(method, route, path, query, ct, body string) string {
		return idempotency.Fingerprint(method, route, path, query, ct, []byte(body))
	}
	base := fp("POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`)
	require.Len(t, base, 64)
	same := []string{
		fp("post", "POST /p", "/p", "b=2&a=1", "Application/JSON; charset=utf-8", "{\"y\":2,\n\"x\":1}"),
	}
	for _, s := range same {
		require.Equal(t, base, s)
	}
	for name, other := range map[string]string{
		"method":       fp("PATCH", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
		"route":        fp("POST", "POST /q", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
		"path":         fp("POST", "POST /p", "/p2", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
		"query":        fp("POST", "POST /p", "/p", "a=1&b=3", "application/json", `{"x":1,"y":2}`),
		"content type": fp("POST", "POST /p", "/p", "a=1&b=2", "text/plain", `{"x":1,"y":2}`),
		"body":         fp("POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":3}`),
		"number text":  fp("POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1.0,"y":2}`),
		"field split":  fp("POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`+" "),
	} {
		if name == "field split" {
			require.Equal(t, base, other, "trailing whitespace is insignificant in JSON")
			continue
		}
		require.NotEqual(t, base, other, name)
	}
	// Non-JSON bodies are hashed raw; invalid JSON too.
	require.NotEqual(t, fp("POST", "r", "/", "", "text/plain", "a b"), fp("POST", "r", "/", "", "text/plain", "a  b"))
	require.NotEqual(t, fp("POST", "r", "/", "", "application/json", "{bad"), fp("POST", "r", "/", "", "application/json", "{bad "))
	// Length prefixes: moving bytes between fields changes the hash.
	require.NotEqual(t, fp("POST", "ab", "/", "", "", ""), fp("POST", "a", "b/", "", "", ""))
}

func TestStoredRequest(t *testing.T) {
	in := idempotency.StoredRequest{Method: "POST", URL: "/p?a=1", Host: "h", ContentType: "application/json", Body: []byte{0, 1, 2}}
	out, err := idempotency.DecodeRequest(in.Encode())
	require.NoError(t, err)
	require.Equal(t, in, out)
	_, err = idempotency.DecodeRequest([]byte("{"))
	require.ErrorIs(t, err, idempotency.ErrBadRequestRecord)
}
