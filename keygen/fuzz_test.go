package keygen

import (
	"errors"
	"strings"
	"testing"
)

func FuzzValidate(f *testing.F) {
	for _, s := range []string{"", "k", "order 42", "a\x00", "caf\u00e9", strings.Repeat("k", 256), "3f1e2a4b-5c6d-4e7f-8a9b-0c1d2e3f4a5b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		err := Validate(key)
		valid := len(key) >= 1 && len(key) <= maxLen && key[0] != ' ' && key[len(key)-1] != ' '
		for i := 0; valid && i < len(key); i++ {
			valid = key[i] >= 0x20 && key[i] <= 0x7E
		}
		if valid != (err == nil) {
			t.Fatalf("Validate(%q) = %v, reference says valid=%v", key, err, valid)
		}
		if err == nil {
			return
		}
		var ike *InvalidKeyError
		if !errors.As(err, &ike) || !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("Validate(%q) returned %T %v", key, err, err)
		}
		if len(err.Error()) > 300 {
			t.Fatalf("message too long: %d bytes", len(err.Error()))
		}
		if ike.Reason == reasonInvalidChar {
			if c := key[ike.Pos]; c >= 0x20 && c <= 0x7E {
				t.Fatalf("Pos %d points at valid byte %q", ike.Pos, c)
			}
		}
		if ike.Reason == reasonOuterSpace && (key[ike.Pos] != ' ' || ike.Pos != 0 && ike.Pos != len(key)-1) {
			t.Fatalf("Pos %d of %q is not an outer space", ike.Pos, key)
		}
	})
}

func FuzzEvent(f *testing.F) {
	f.Add("order-confirm", "42", "order", "confirm-42")
	f.Add("a-b", "c", "a", "b-c")
	f.Add("", "", "-", "")
	f.Add("x%2D", "y", "x-", "y")
	f.Add(strings.Repeat("e", 200), strings.Repeat("-", 100), strings.Repeat("e", 200), strings.Repeat("-", 101))
	f.Fuzz(func(t *testing.T, a, b, c, d string) {
		k1, k2 := Event(a, b), Event(c, d)
		for _, k := range []string{k1, k2} {
			if err := Validate(k); err != nil {
				t.Fatalf("Event output %q does not validate: %v", k, err)
			}
			// Event keys are a subset of valid keys: bare header values
			// with no space, quote, backslash or comma.
			if strings.ContainsAny(k, " \"\\,") || FormatHeader(k) != k {
				t.Fatalf("Event output %q needs quoting", k)
			}
			if k != Event(a, b) && k != Event(c, d) {
				t.Fatal("Event is not deterministic")
			}
		}
		if !strings.Contains(k1, hashMarker) {
			parts, err := decodeEvent(k1, 2)
			if err != nil || parts[0] != a || parts[1] != b {
				t.Fatalf("Event(%q, %q) = %q decodes to %q, %v", a, b, k1, parts, err)
			}
		}
		if (a != c || b != d) && k1 == k2 {
			t.Fatalf("collision: Event(%q, %q) == Event(%q, %q) == %q", a, b, c, d, k1)
		}
		if k := Event(a); a != "" && Validate(k) != nil {
			t.Fatalf("Event(%q) = %q does not validate", a, k)
		}
	})
}
