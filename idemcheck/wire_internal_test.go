package idemcheck

import (
	"bytes"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

func TestAlterBody(t *testing.T) {
	for _, tc := range []struct{ body, ct, want string }{
		{`{"order":"42","amount":4200}`, "application/json", `{"amount":4201,"order":"42"}`},
		{`{"b":1.5,"a":"x"}`, "application/json; charset=utf-8", `{"a":"x","b":2.5}`},
		{`{"n":9223372036854775807}`, "application/json", `{"n":9223372036854775806}`},
		{`{"n":1e300}`, "application/vnd.api+json", `{"n":5e+299}`},
		{`{"name":"a<b"}`, "", `{"idemcheck":1,"name":"a<b"}`},
		{`{"idemcheck":"x"}`, "application/json", `{"idemcheck":"x","idemcheck_1":1}`},
		{`[1,2]`, "application/json", `[1,2] idemcheck`},
		{`{"a":1} {"b":2}`, "application/json", `{"a":1} {"b":2} idemcheck`},
		{`amount=4200`, "application/x-www-form-urlencoded", `amount=4200&idemcheck=1`},
		{``, "application/x-www-form-urlencoded", `idemcheck=1`},
		{`hello`, "text/plain", `hello idemcheck`},
		{``, "", ` idemcheck`},
	} {
		if got := string(alterBody([]byte(tc.body), tc.ct)); got != tc.want {
			t.Errorf("alterBody(%q, %q) = %q, want %q", tc.body, tc.ct, got, tc.want)
		}
	}
}

func FuzzAlterBody(f *testing.F) {
	f.Add([]byte(`{"order":"42","amount":4200}`), "application/json")
	f.Add([]byte(`{"a":{"b":1},"c":-0.0}`), "")
	f.Add([]byte(`a=1&b=2`), "application/x-www-form-urlencoded")
	f.Add([]byte{0xff, 0x00}, "text/plain")
	f.Fuzz(func(t *testing.T, body []byte, ct string) {
		orig := bytes.Clone(body)
		got := alterBody(body, ct)
		if bytes.Equal(got, body) {
			t.Fatalf("alterBody(%q, %q) did not change the body", body, ct)
		}
		if !bytes.Equal(body, orig) {
			t.Fatalf("alterBody modified its input")
		}
		if !bytes.Equal(alterBody(body, ct), got) {
			t.Fatalf("alterBody is not deterministic")
		}
	})
}

func TestEffectID(t *testing.T) {
	for _, tc := range []struct {
		body, field, want string
		ok                bool
	}{
		{`{"id":"ch_1"}`, "id", "ch_1", true},
		{`{"id":12345678901234567890}`, "id", "12345678901234567890", true},
		{`{"data":{"id":"x"}}`, "data.id", "x", true},
		{`{"data":{"id":{"a":1}}}`, "data.id", `{"a":1}`, true},
		{`{"id":null}`, "id", "", false},
		{`{"data":"x"}`, "data.id", "", false},
		{`not json`, "id", "", false},
		{`{"other":1}`, "id", "", false},
	} {
		got, ok := effectID([]byte(tc.body), tc.field)
		if got != tc.want || ok != tc.ok {
			t.Errorf("effectID(%q, %q) = %q, %v; want %q, %v", tc.body, tc.field, got, ok, tc.want, tc.ok)
		}
	}
}

func FuzzEffectID(f *testing.F) {
	f.Add([]byte(`{"id":"ch_1"}`), "id")
	f.Add([]byte(`{"data":{"id":[1,2]}}`), "data.id")
	f.Add([]byte(`{"a":{"":1}}`), "a.")
	f.Fuzz(func(t *testing.T, body []byte, field string) {
		id, ok := effectID(body, field)
		if !ok && id != "" {
			t.Fatalf("effectID(%q, %q) = %q without a member", body, field, id)
		}
		if id2, ok2 := effectID(body, field); id2 != id || ok2 != ok {
			t.Fatal("effectID is not deterministic")
		}
	})
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"1", time.Second, true},
		{" 120 ", 2 * time.Minute, true},
		{"0", 0, true},
		{now.Add(3 * time.Second).Format(http.TimeFormat), 3 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
		{"99999999999999999999", 0, false},
		{"9999999999999999", time.Duration(1<<63 - 1), true},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"", 0, false},
	} {
		got, ok := retryAfter(tc.v, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("retryAfter(%q) = %v, %v; want %v, %v", tc.v, got, ok, tc.want, tc.ok)
		}
	}
}

func FuzzRetryAfter(f *testing.F) {
	f.Add("1")
	f.Add("Fri, 02 Jan 2026 03:04:08 GMT")
	f.Add("18446744073709551615")
	f.Fuzz(func(t *testing.T, v string) {
		now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
		d, ok := retryAfter(v, now)
		if d < 0 || (!ok && d != 0) {
			t.Fatalf("retryAfter(%q) = %v, %v", v, d, ok)
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32); err == nil && d != time.Duration(n)*time.Second {
			t.Fatalf("retryAfter(%q) = %v, want %d s", v, d, n)
		}
	})
}

func FuzzShowBytes(f *testing.F) {
	f.Add([]byte(`{"id":"ch_1"}`))
	f.Add([]byte("line\nbreak\x00"))
	f.Add([]byte(strings.Repeat("é", 100)))
	f.Fuzz(func(t *testing.T, b []byte) {
		s := showBytes(b)
		if !utf8.ValidString(s) || strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Fatalf("showBytes(%q) = %q: not one printable line", b, s)
		}
		if len(s) > 4*120+40 { // 120 bytes, each quoted as \xNN at most, and the tail
			t.Fatalf("showBytes(%d bytes) is %d bytes long", len(b), len(s))
		}
	})
}
