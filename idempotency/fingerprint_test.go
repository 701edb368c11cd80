package idempotency_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// The reviewer's collisions: different bodies that decoding maps to one
// value get different fingerprints.
func TestFingerprintNoCollisions(t *testing.T) {
	fp := func(body string) string {
		return idempotency.Fingerprint("POST", "POST /p", "/p", "", "application/json", []byte(body))
	}
	for _, pair := range [][2]string{
		{"\"\xff\"", "\"\xfe\""},
		{"\"\xff\"", `"\ufffd"`},
		{`"\ud800"`, `"\udfff"`},
		{`"\ud800"`, `"\ufffd"`},
		{`{"amount":1,"amount":1000}`, `{"amount":1000}`},
		{`{"amount":1000,"amount":1}`, `{"amount":1,"amount":1000}`},
	} {
		require.NotEqual(t, fp(pair[0]), fp(pair[1]), "%q and %q", pair[0], pair[1])
	}
	// Equal bodies still match: escapes, key order, whitespace.
	require.Equal(t, fp(`{"a":"\u00e9","b":[1,2]}`), fp(`{ "b" : [1,2], "a" : "é" }`))
	require.Equal(t, fp(`"\ud83d\ude00"`), fp(`"😀"`))
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

// TestFingerprintIsStable pins fingerprints computed by an earlier release:
// stored records compare against them, so any change of the hashed bytes
// must come with a new FingerprintVersion.
func TestFingerprintIsStable(t *testing.T) {
	require.Equal(t, "ab36fdb8bf8591c5cfb3e0a319c746d2a3eedac4693f42891b6f9de2f41607d8",
		idempotency.Fingerprint("post", "/r", "/p", "b=2&a=1", "application/json; charset=utf-8",
			[]byte(`{"b":[1,2,{"z":"\u00e9","a":null}],"a":"x"}`)))
	require.Equal(t, "c00f0b07a076c11affe4e2e268a3510bb9226f97d71cc3e1b58bd11f3445f93f",
		idempotency.Fingerprint("PUT", "", "/", "", "text/plain", []byte("raw")))
	require.Equal(t, "df7f2cd32ea365b9cf35912c5093e40f88c7e3d04d98c5d6c2f1c208333cf8d3",
		idempotency.Fingerprint("POST", "r", "/", "", "application/json", []byte(`{"a":1,"a":2}`)),
		"a repeated key is hashed raw")
}
