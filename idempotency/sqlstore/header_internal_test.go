package sqlstore

import (
	"bytes"
	"net/http"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
)

// FuzzHeaderRoundTrip checks that any header survives encodeHeader and
// decodeHeader byte for byte, and that decodeHeader refuses (never panics
// on, never over-allocates for) arbitrary input, and re-encodes what it
// accepts to the same bytes.
func FuzzHeaderRoundTrip(f *testing.F) {
	f.Add("Content-Disposition", "attachment; filename=\"r\xe9sum\xe9.pdf\"", "\xff\x00", []byte{headerFormat, 0})
	f.Add("", "", "", []byte{})
	f.Add("X", "a", "b", []byte{headerFormat, 1, 1, 'X', 2, 1, 'a', 0})
	f.Add("\x00", "\xc3\x28", "", []byte{headerFormat, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, name, v1, v2 string, raw []byte) {
		h := http.Header{name: {v1, v2}, "Other": {}, name + "2": {v2}}
		got, err := decodeHeader(encodeHeader(h))
		if err != nil {
			t.Fatalf("decode(encode(%q)): %v", h, err)
		}
		if len(got) != len(h) {
			t.Fatalf("round trip of %q = %q", h, got)
		}
		for k, vs := range h {
			gv, ok := got[k]
			if !ok || len(gv) != len(vs) {
				t.Fatalf("round trip of %q = %q", h, got)
			}
			for i := range vs {
				if gv[i] != vs[i] {
					t.Fatalf("round trip of %q: %q value %d = %q", h, k, i, gv[i])
				}
			}
		}
		if d, err := decodeHeader(raw); err == nil {
			if again := encodeHeader(d); !bytes.Equal(again, raw) && raw != nil {
				// The encoding is canonical (names sorted, minimal
				// varints) except for the order decodeHeader accepts
				// names in: compare decoded forms instead.
				d2, err := decodeHeader(again)
				if err != nil || len(d2) != len(d) {
					t.Fatalf("decoded %x to %q, which re-encodes to %x (%v)", raw, d, again, err)
				}
			}
		}
	})
}

func TestHeaderNilAndEmpty(t *testing.T) {
	if encodeHeader(nil) != nil {
		t.Fatal("nil header must encode as nil (SQL NULL)")
	}
	h, err := decodeHeader(nil)
	if err != nil || h != nil {
		t.Fatalf("decodeHeader(nil) = %v, %v", h, err)
	}
	h, err = decodeHeader(encodeHeader(http.Header{}))
	if err != nil || h == nil || len(h) != 0 {
		t.Fatalf("empty header round trip = %#v, %v", h, err)
	}
	for _, bad := range [][]byte{{}, {0}, {2, 0}, {headerFormat}, {headerFormat, 1}, {headerFormat, 0, 0},
		{headerFormat, 2, 1, 'a', 0, 1, 'a', 0}} {
		if _, err := decodeHeader(bad); err == nil {
			t.Errorf("decodeHeader(%x) accepted", bad)
		}
	}
}

// TestScopeHashSeparatesParts checks that the digest depends on where each
// part ends, not only on the concatenated bytes.
func TestScopeHashSeparatesParts(t *testing.T) {
	a := scopeHash(idempotency.Scope{Principal: "ab", Method: "c", Route: "d", Key: "e"})
	b := scopeHash(idempotency.Scope{Principal: "a", Method: "bc", Route: "d", Key: "e"})
	c := scopeHash(idempotency.Scope{Principal: "ab", Method: "c", Route: "d", Key: "e"})
	if bytes.Equal(a, b) || !bytes.Equal(a, c) || len(a) != 32 {
		t.Fatalf("scopeHash: %x %x %x", a, b, c)
	}
}
