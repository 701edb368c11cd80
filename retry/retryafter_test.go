package retry

import (
	"math"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// maxDuration is the largest time.Duration, what a huge hint saturates at.
const maxDuration = time.Duration(math.MaxInt64)

// maxDeltaSeconds is the largest delta-seconds that fits in a Duration.
const maxDeltaSeconds = int64(maxDuration / time.Second)

func TestParseRetryAfter(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"0", 0, true},
		{"1", time.Second, true},
		{"120", 2 * time.Minute, true},
		{" 5\t", 5 * time.Second, true},
		{"007", 7 * time.Second, true},
		{"9223372036", 9223372036 * time.Second, true},
		{"9223372037", maxDuration, true}, // first value above the limit
		{"99999999999999999999", maxDuration, true},
		{"999999999999999999999999999999999999999", maxDuration, true},
		{"", 0, false},
		{"   ", 0, false},
		{"-1", 0, false},
		{"+5", 0, false},
		{"1.5", 0, false},
		{"1e3", 0, false},
		{"5s", 0, false},
		{"soon", 0, false},
		{"0x10", 0, false},
		{"５", 0, false}, // full-width digit
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(90 * time.Second).Format(time.RFC850), 90 * time.Second, true},
		{now.Add(90 * time.Second).Format(time.ANSIC), 90 * time.Second, true},
		{now.Format(http.TimeFormat), 0, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
		{"Thu, 01 Jan 1970 00:00:00 GMT", 0, true},
		{"Fri, 31 Dec 9999 23:59:59 GMT", maxDuration, true}, // t.Sub saturates
		{"Wed, 32 Oct 2026 07:28:00 GMT", 0, false},
		{"2026-03-04T05:06:07Z", 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			d, ok := parseRetryAfter(tc.in, now)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, d)
		})
	}
}

func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"0", "120", "-1", "", "99999999999999999999", "1.5", " 3 ",
		"Wed, 21 Oct 2015 07:28:00 GMT", "Sunday, 06-Nov-94 08:49:37 GMT", "Sun Nov  6 08:49:37 1994",
		now.Add(time.Minute).Format(http.TimeFormat)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, ok := parseRetryAfter(s, now)
		if !ok {
			if d != 0 {
				t.Fatalf("parseRetryAfter(%q) = %v, false: want 0 when not ok", s, d)
			}
			return
		}
		if d < 0 {
			t.Fatalf("parseRetryAfter(%q) = %v, true: negative", s, d)
		}
		if d%time.Second != 0 && d != maxDuration {
			t.Fatalf("parseRetryAfter(%q) = %v: not whole seconds", s, d)
		}
		// A valid delta-seconds value round-trips.
		if n, err := strconv.ParseInt(s, 10, 64); err == nil && n >= 0 && n <= maxDeltaSeconds && s == strconv.FormatInt(n, 10) {
			if d != time.Duration(n)*time.Second {
				t.Fatalf("parseRetryAfter(%q) = %v, want %ds", s, d, n)
			}
		}
		// Parsing is deterministic and independent of later calls.
		d2, ok2 := parseRetryAfter(s, now)
		if d2 != d || ok2 != ok {
			t.Fatalf("parseRetryAfter(%q) not deterministic", s)
		}
	})
}
