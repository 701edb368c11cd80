package redisstore

import (
	"net/http"
	"reflect"
	"testing"
)

// FuzzDecodeHeader: decodeHeader never panics, refuses or returns a header
// whose encoding is the input (the encoding is canonical: sorted names).
func FuzzDecodeHeader(f *testing.F) {
	for _, h := range []http.Header{{}, {"A": {"1", ""}, "B": {}}, {"X-Raw": {"\xff\x00"}}} {
		f.Add(string(encodeHeader(h)))
	}
	f.Add("\x01\x05")
	f.Add("\x02")
	f.Fuzz(func(t *testing.T, b string) {
		h, err := decodeHeader(b)
		if err != nil {
			return
		}
		if got := string(encodeHeader(h)); got != b {
			t.Fatalf("decode(%q) = %q, which encodes as %q", b, h, got)
		}
	})
}

// FuzzHeaderRoundTrip: every header survives encode and decode.
func FuzzHeaderRoundTrip(f *testing.F) {
	f.Add("Content-Type", "application/json", "X", "")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		h := http.Header{k1: {v1, v2}, k2: {}}
		if k1 == k2 {
			h = http.Header{k1: {v1, v2}}
		}
		got, err := decodeHeader(string(encodeHeader(h)))
		if err != nil || !reflect.DeepEqual(got, h) {
			t.Fatalf("round trip of %q: %q, %v", h, got, err)
		}
	})
}
