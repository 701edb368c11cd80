package idempotency

import (
	"mime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func fp(v int, method, route, path, query, ct, body string) string {
	s, ok := fingerprint(fingerprintInput{method, route, path, query, ct, []byte(body)}, v)
	if !ok {
		panic("unknown version")
	}
	return s
}

// Different bodies that decoding maps to one value get different
// fingerprints.
func TestFingerprintNoCollisions(t *testing.T) {
	f := func(body string) string { return fp(2, "POST", "POST /p", "/p", "", "application/json", body) }
	for _, pair := range [][2]string{
		{"\"\xff\"", "\"\xfe\""},
		{"\"\xff\"", `"\ufffd"`},
		{`"\ud800"`, `"\udfff"`},
		{`"\ud800"`, `"\ufffd"`},
		{`{"amount":1,"amount":1000}`, `{"amount":1000}`},
		{`{"amount":1000,"amount":1}`, `{"amount":1,"amount":1000}`},
		// encoding/json matches names without regard to case, the last
		// one winning: 1000, then 1.
		{`{"amount":1,"AMOUNT":1000}`, `{"AMOUNT":1000,"amount":1}`},
		{`{"x":{"Id":"a","id":"b"}}`, `{"x":{"id":"b","Id":"a"}}`},
	} {
		require.NotEqual(t, f(pair[0]), f(pair[1]), "%q and %q", pair[0], pair[1])
	}
	// Equal bodies still match: escapes, key order, whitespace.
	require.Equal(t, f(`{"a":"\u00e9","b":[1,2]}`), f(`{ "b" : [1,2], "a" : "é" }`))
	require.Equal(t, f(`"\ud83d\ude00"`), f(`"😀"`))
}

func TestFingerprint(t *testing.T) {
	for v := 1; v <= 2; v++ {
		base := fp(v, "POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`)
		require.Len(t, base, 64)
		require.Equal(t, base, fp(v, "post", "POST /p", "/p", "b=2&a=1", "Application/JSON", "{\"y\":2,\n\"x\":1} "))
		for name, other := range map[string]string{
			"method":       fp(v, "PATCH", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
			"route":        fp(v, "POST", "POST /q", "/p", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
			"path":         fp(v, "POST", "POST /p", "/p2", "a=1&b=2", "application/json", `{"x":1,"y":2}`),
			"query":        fp(v, "POST", "POST /p", "/p", "a=1&b=3", "application/json", `{"x":1,"y":2}`),
			"content type": fp(v, "POST", "POST /p", "/p", "a=1&b=2", "text/plain", `{"x":1,"y":2}`),
			"body":         fp(v, "POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1,"y":3}`),
			"number text":  fp(v, "POST", "POST /p", "/p", "a=1&b=2", "application/json", `{"x":1.0,"y":2}`),
		} {
			require.NotEqual(t, base, other, "version %d: %s", v, name)
		}
		// Non-JSON bodies are hashed raw; invalid JSON too.
		require.NotEqual(t, fp(v, "POST", "r", "/", "", "text/plain", "a b"), fp(v, "POST", "r", "/", "", "text/plain", "a  b"))
		require.NotEqual(t, fp(v, "POST", "r", "/", "", "application/json", "{bad"), fp(v, "POST", "r", "/", "", "application/json", "{bad "))
		// Length prefixes: moving bytes between fields changes the hash.
		require.NotEqual(t, fp(v, "POST", "ab", "/", "", "", ""), fp(v, "POST", "a", "b/", "", "", ""))
	}
	_, ok := fingerprint(fingerprintInput{}, 3)
	require.False(t, ok, "an unknown version")
}

// Version 2 keeps the content type's parameters: the same bytes under
// another multipart boundary, or in another charset, mean another body.
// Version 1 dropped them; it is kept to compare records that hold it.
func TestFingerprintKeepsContentTypeParameters(t *testing.T) {
	body := "--X\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n1\r\n--X--\r\n"
	x := fp(2, "POST", "POST /p", "/p", "", "multipart/form-data; boundary=X", body)
	require.NotEqual(t, x, fp(2, "POST", "POST /p", "/p", "", "multipart/form-data; boundary=Y", body))
	require.NotEqual(t, fp(2, "POST", "POST /p", "/p", "", "text/plain; charset=utf-8", "caf\xc3\xa9"),
		fp(2, "POST", "POST /p", "/p", "", "text/plain; charset=iso-8859-1", "caf\xc3\xa9"))
	// The same parameters spelled differently are the same content type.
	require.Equal(t, x, fp(2, "POST", "POST /p", "/p", "", `Multipart/Form-Data; BOUNDARY="X"`, body))
	require.Equal(t, fp(1, "POST", "POST /p", "/p", "", "multipart/form-data; boundary=X", body),
		fp(1, "POST", "POST /p", "/p", "", "multipart/form-data; boundary=Y", body))
}

// TestFingerprintIsStable pins the fingerprints that stored records hold:
// stored records compare against them, so any change of the hashed bytes
// must come with a new version. The version 1 values are golden: computed
// by the implementation that wrote version 1 records, so that this code is
// checked against it, not against itself.
func TestFingerprintIsStable(t *testing.T) {
	for _, tc := range []struct{ want, method, route, path, query, ct, body string }{
		{"ab36fdb8bf8591c5cfb3e0a319c746d2a3eedac4693f42891b6f9de2f41607d8",
			"post", "/r", "/p", "b=2&a=1", "application/json; charset=utf-8", `{"b":[1,2,{"z":"\u00e9","a":null}],"a":"x"}`},
		{"c00f0b07a076c11affe4e2e268a3510bb9226f97d71cc3e1b58bd11f3445f93f",
			"PUT", "", "/", "", "text/plain", "raw"},
		{"df7f2cd32ea365b9cf35912c5093e40f88c7e3d04d98c5d6c2f1c208333cf8d3", // a repeated key: raw
			"POST", "r", "/", "", "application/json", `{"a":1,"a":2}`},
		{"e0fa90f2e1df83e1caaf3a74ff49a4c5f6d8ea50e493ad624fe16a46d821b006", // without the boundary
			"POST", "POST /payments", "/payments", "", "multipart/form-data; boundary=X",
			"--X\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n1\r\n--X--\r\n"},
		{"5faf6b710a2f44a8c977ebb0e67cf6eb0f7f8fd16473857a39e00972e22de9d2", // keys equal under folding: canonical
			"POST", "POST /payments", "/payments", "", "application/json", `{"amount":1,"AMOUNT":1000}`},
		{"5faf6b710a2f44a8c977ebb0e67cf6eb0f7f8fd16473857a39e00972e22de9d2",
			"POST", "POST /payments", "/payments", "", "application/json", `{"AMOUNT":1000,"amount":1}`},
	} {
		require.Equal(t, tc.want, fp(1, tc.method, tc.route, tc.path, tc.query, tc.ct, tc.body), "version 1 of %q", tc.body)
	}
	require.Equal(t, "4743565cf54ac44119246ed5b6fd60b0cb76a32b6b29f6b9c475fbf6170e2f4c",
		fp(2, "post", "/r", "/p", "b=2&a=1", "application/json; charset=utf-8", `{"b":[1,2,{"z":"\u00e9","a":null}],"a":"x"}`))
}

// mediaTypeV1 is how version 1 reduced a content type: its media type,
// lower-cased, or the part before ";" when it does not parse.
func mediaTypeV1(ct string) string {
	if ct == "" {
		return ""
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		mt, _, _ = strings.Cut(ct, ";")
	}
	return strings.ToLower(strings.TrimSpace(mt))
}

// contentType's media type is version 1's, its full form is
// mime.FormatMediaType's of what mime.ParseMediaType reads, and it is
// stable: the form of a form is itself.
func FuzzContentType(f *testing.F) {
	for _, s := range []string{"application/json", " Application/JSON ", "text/plain; charset=utf-8", "json",
		"a/b/c", "\xff/x", "x/y\u0085", "bad type", `a/b"c`, "İ/x", `multipart/form-data; boundary="a b"`, "a/b; c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ct string) {
		mt, full := contentType(ct)
		if want := mediaTypeV1(ct); mt != want {
			t.Fatalf("contentType(%q) media type %q, version 1 says %q", ct, mt, want)
		}
		if pmt, params, err := mime.ParseMediaType(ct); err == nil {
			want := mime.FormatMediaType(pmt, params)
			if want == "" {
				want = "raw:" + ct
			}
			if full != want {
				t.Fatalf("contentType(%q) = %q, mime.FormatMediaType %q", ct, full, want)
			}
		}
		if !strings.HasPrefix(full, "raw:") {
			if _, again := contentType(full); again != full {
				t.Fatalf("contentType(%q) = %q, whose form is %q", ct, full, again)
			}
		}
	})
}
