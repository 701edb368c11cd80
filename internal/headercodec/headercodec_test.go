package headercodec

import (
	"bytes"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// FuzzCodec checks that any header survives Encode and Decode, with its
// names and values byte for byte, and that Decode never panics or
// over-allocates on arbitrary input: it refuses it with ErrMalformed, or
// returns a header that Encode turns back into the same bytes.
func FuzzCodec(f *testing.F) {
	f.Add("Content-Disposition", "attachment; filename=\"r\xe9sum\xe9.pdf\"", "\xff\x00",
		[]byte{format, 0})
	f.Add("", "", "", []byte{})
	f.Add("X", "a", "b", []byte{format, 1, 1, 'X', 2, 1, 'a', 0})
	f.Add("\x00", "\xc3\x28", "", []byte{format, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add("Content-Type", "application/json", "", []byte("\x01\x05"))
	f.Add("Other", "", "", []byte("\x02"))
	for _, h := range []http.Header{{}, {"A": {"1", ""}, "B": {}}, {"X-Raw": {"\xff\x00"}}} {
		f.Add("", "", "", Encode(h))
	}
	f.Fuzz(func(t *testing.T, name, v1, v2 string, raw []byte) {
		h := http.Header{name: {v1, v2}, "Other": {}, name + "2": {v2}}
		got, err := Decode(Encode(h))
		if err != nil || !reflect.DeepEqual(got, h) {
			t.Fatalf("Decode(Encode(%q)) = %q, %v", h, got, err)
		}
		d, err := Decode(raw)
		if err != nil {
			if d != nil || !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode(%x) = %q, %v, want nil, ErrMalformed", raw, d, err)
			}
			return
		}
		if again := Encode(d); !bytes.Equal(again, raw) || (again == nil) != (raw == nil) {
			t.Fatalf("Decode(%x) = %q, which encodes as %x", raw, d, again)
		}
	})
}

// TestLayout pins the stored bytes, written out by hand from the layout in
// the package documentation: records already stored decode, and a store
// writes what it always wrote.
func TestLayout(t *testing.T) {
	long := strings.Repeat("v", 200)
	for _, c := range []struct {
		h    http.Header
		want string
	}{
		{nil, ""},
		{http.Header{}, "\x01\x00"},
		{http.Header{"B": {"x"}, "A": {"1", ""}, "C": {}},
			"\x01\x03" + "\x01A\x02\x011\x00" + "\x01B\x01\x01x" + "\x01C\x00"},
		{http.Header{"a": {"1"}, "B": {"2"}, "": {"3"}},
			"\x01\x03" + "\x00\x01\x013" + "\x01B\x01\x012" + "\x01a\x01\x011"},
		{http.Header{"X-Raw": {"\xff\x00"}}, "\x01\x01\x05X-Raw\x01\x02\xff\x00"},
		{http.Header{"L": {long}}, "\x01\x01\x01L\x01\xc8\x01" + long},
	} {
		got := Encode(c.h)
		if string(got) != c.want || (got == nil) != (c.h == nil) {
			t.Errorf("Encode(%q) = %q, want %q", c.h, got, c.want)
		}
		back, err := Decode(got)
		if err != nil || !reflect.DeepEqual(back, c.h) {
			t.Errorf("Decode(%q) = %q, %v, want %q", got, back, err, c.h)
		}
	}
}

func TestNilAndEmpty(t *testing.T) {
	if Encode(nil) != nil {
		t.Fatal("a nil header must encode as nil (SQL NULL, no field)")
	}
	h, err := Decode(nil)
	if err != nil || h != nil {
		t.Fatalf("Decode(nil) = %v, %v", h, err)
	}
	h, err = Decode(Encode(http.Header{}))
	if err != nil || h == nil || len(h) != 0 {
		t.Fatalf("empty header round trip = %#v, %v", h, err)
	}
	h, err = Decode(Encode(http.Header{"A": nil}))
	if err != nil || h["A"] == nil || len(h["A"]) != 0 {
		t.Fatalf("a nil list of values decodes as %#v, %v, want an empty one", h, err)
	}
}

// TestDecodeRefuses lists inputs that Encode never writes.
func TestDecodeRefuses(t *testing.T) {
	for _, bad := range []struct {
		b    string
		what string
	}{
		{"", "empty, not nil"},
		{"\x00", "format 0"},
		{"\x02\x00", "format 2"},
		{"\x01", "no count"},
		{"\x01\x01", "a name missing"},
		{"\x01\x00\x00", "a byte after the last name"},
		{"\x01\x01\x01a", "no count of values"},
		{"\x01\x01\x01a\x01", "a value missing"},
		{"\x01\x01\x01a\x01\x02x", "a value cut short"},
		{"\x01\x02\x01a\x00\x01a\x00", "a name given twice"},
		{"\x01\x02\x010\x00\x01 \x00", "names out of order"},
		{"\x01\x80\x00", "a count of 0 not in its shortest encoding"},
		{"\x01\x01\x81\x00a\x00", "a length of 1 not in its shortest encoding"},
		{"\x01\xff\xff\xff\xff\x0f", "a count past the input's length"},
		{"\x01\x01\x01a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "a count of 2^64-1 values"},
		{"\x01\x01\x01a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02", "a count past 64 bits"},
		{"\x01\x01\x01a\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "an 11-byte varint"},
	} {
		h, err := Decode([]byte(bad.b))
		if err == nil || h != nil || !errors.Is(err, ErrMalformed) {
			t.Errorf("Decode(%q) (%s) = %q, %v, want ErrMalformed", bad.b, bad.what, h, err)
		}
	}
}
