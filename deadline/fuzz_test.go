package deadline

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

func FuzzParse(f *testing.F) {
	for _, s := range []string{"0", "2500", "-5", "+5", "1.5", "", " 7 ", "9223372036854", "9223372036855", "007", "5, 6"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		d, err := Parse(v)
		if err != nil {
			var he *HeaderError
			if !errors.As(err, &he) || !errors.Is(err, ErrInvalidHeader) {
				t.Fatalf("Parse(%q) returned %T %v", v, err, err)
			}
			if d != 0 {
				t.Fatalf("Parse(%q) returned %v with an error", v, d)
			}
			return
		}
		if d < 0 || d%time.Millisecond != 0 {
			t.Fatalf("Parse(%q) = %v", v, d)
		}
		// Accepted values agree with strconv on the trimmed digits.
		n, perr := strconv.ParseUint(trimOWS(v), 10, 63)
		if perr != nil || time.Duration(n)*time.Millisecond != d {
			t.Fatalf("Parse(%q) = %v, strconv says %d, %v", v, d, n, perr)
		}
		back, err := Parse(Format(d))
		if err != nil || back != d {
			t.Fatalf("round trip of %v: %v, %v", d, back, err)
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
