package deadline

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

func FuzzParse(f *testing.F) {
	for _, s := range []string{"0", "2500", "-5", "+5", "1.5", "", " 7 ", "9223372036854", "9223372036855", "99999999999999999999999999", "007", "5, 6"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		d, ok := parse(v)
		if !ok {
			if d != 0 {
				t.Fatalf("parse(%q) refused, with %v", v, d)
			}
			return
		}
		if d < 0 || d%time.Millisecond != 0 {
			t.Fatalf("parse(%q) = %v", v, d)
		}
		// Accepted values agree with strconv on the trimmed digits, clamped
		// to 5 minutes however many there are.
		want := maxPropagated
		n, perr := strconv.ParseUint(trimOWS(v), 10, 64)
		switch {
		case perr == nil && n < uint64(maxPropagated/time.Millisecond):
			want = time.Duration(n) * time.Millisecond
		case perr != nil && !errors.Is(perr, strconv.ErrRange):
			t.Fatalf("parse(%q) = %v, strconv refuses it: %v", v, d, perr)
		}
		if d != want {
			t.Fatalf("parse(%q) = %v, want %v", v, d, want)
		}
		back, ok := parse(strconv.FormatInt(d.Milliseconds(), 10))
		if !ok || back != d {
			t.Fatalf("round trip of %v: %v, %v", d, back, ok)
		}
	})
}

func trimOWS(s string) string {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	for len(s) > 0 && (s[len(s)-1] == ' ' || s[len(s)-1] == '\t') {
		s = s[:len(s)-1]
	}
	return s
}
