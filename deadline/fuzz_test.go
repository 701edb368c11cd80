package deadline

import (
	"strconv"
	"testing"
	"time"
)

func FuzzParse(f *testing.F) {
	for _, s := range []string{"0", "2500", "-5", "+5", "1.5", "", " 7 ", "9223372036854", "9223372036855", "007", "5, 6"} {
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
		// Accepted values agree with strconv on the trimmed digits.
		n, perr := strconv.ParseUint(trimOWS(v), 10, 63)
		if perr != nil || time.Duration(n)*time.Millisecond != d {
			t.Fatalf("parse(%q) = %v, strconv says %d, %v", v, d, n, perr)
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
