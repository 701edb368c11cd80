package retry

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The Lists of RFC 9651's examples and of its parsing rules' edges.
func TestParseSFList(t *testing.T) {
	valid := map[string][]sfMember{
		``:           nil,
		`   `:        nil,
		`sugar, tea`: {{item: sfItem{kind: sfToken, str: "sugar"}}, {item: sfItem{kind: sfToken, str: "tea"}}},
		`"a";r=0;t=30`: {{item: sfItem{kind: sfString, str: "a"}, params: []sfParam{
			{"r", sfItem{kind: sfInteger}}, {"t", sfItem{kind: sfInteger, num: 30}}}}},
		`abc;a=1;b=2; cde_456, (ghi;jk=4 l);q="9";r=w`: {
			{item: sfItem{kind: sfToken, str: "abc"}, params: []sfParam{
				{"a", sfItem{kind: sfInteger, num: 1}}, {"b", sfItem{kind: sfInteger, num: 2}},
				{"cde_456", sfItem{kind: sfBoolean, num: 1}}}},
			{inner: true, list: []sfItem{{kind: sfToken, str: "ghi"}, {kind: sfToken, str: "l"}},
				params: []sfParam{{"q", sfItem{kind: sfString, str: "9"}}, {"r", sfItem{kind: sfToken, str: "w"}}}},
		},
		`()`:               {{inner: true}},
		`( 1  2 )`:         {{inner: true, list: []sfItem{{kind: sfInteger, num: 1}, {kind: sfInteger, num: 2}}}},
		`-42, 4.5, -0.001`: {{item: sfItem{kind: sfInteger, num: -42}}, {item: sfItem{kind: sfDecimal, num: 4, milli: 500}}, {item: sfItem{kind: sfDecimal, milli: -1}}},
		`999999999999999`:  {{item: sfItem{kind: sfInteger, num: 999999999999999}}},
		`123456789012.123`: {{item: sfItem{kind: sfDecimal, num: 123456789012, milli: 123}}},
		`"a \"q\" \\ b"`:   {{item: sfItem{kind: sfString, str: `a "q" \ b`}}},
		`:cHJldGVuZCB0aGlzIGlzIGJpbmFyeSBjb250ZW50Lg==:`: {{item: sfItem{kind: sfBytes, str: "pretend this is binary content."}}},
		`:YQ:, :YQ=:, ::`: {{item: sfItem{kind: sfBytes, str: "a"}}, {item: sfItem{kind: sfBytes, str: "a"}}, {item: sfItem{kind: sfBytes}}},
		`?1, ?0`:          {{item: sfItem{kind: sfBoolean, num: 1}}, {item: sfItem{kind: sfBoolean}}},
		`@1659578233`:     {{item: sfItem{kind: sfDate, num: 1659578233}}},
		`%"This is intended for display to %c3%bcsers."`: {{item: sfItem{kind: sfDisplay, str: "This is intended for display to üsers."}}},
		`*foo/bar:baz, a;*k=1`: {{item: sfItem{kind: sfToken, str: "*foo/bar:baz"}},
			{item: sfItem{kind: sfToken, str: "a"}, params: []sfParam{{"*k", sfItem{kind: sfInteger, num: 1}}}}},
		"a,\tb":    {{item: sfItem{kind: sfToken, str: "a"}}, {item: sfItem{kind: sfToken, str: "b"}}},
		`a ,  b  `: {{item: sfItem{kind: sfToken, str: "a"}}, {item: sfItem{kind: sfToken, str: "b"}}},
	}
	for in, want := range valid {
		got, ok := parseSFList(in)
		require.True(t, ok, "%q", in)
		require.Equal(t, want, got, "%q", in)
	}
	for _, in := range []string{
		`a,`, `,a`, `a,,b`, `a b`, "\ta", `"a`, `"a\b"`, `"é"`, "\"a\x01\"", `(a`, `(a b`, `(a,b)`, `(a)b`,
		`1234567890123456`, `1234567890123.1`, `1.1234`, `1.`, `-`, `-a`, `1..2`, `:YQ`, `:Y Q:`, `:YQ===:`,
		`:YWJj=:`, `:Y=Q:`, `?2`, `?`, `@1.5`, `@x`, `%"a`, `%a`, `%"%C3%BC"`, `%"%c3"`, `%"%zz"`, `%"é"`,
		`a;`, `a;B=1`, `a;=1`, `a;k=`, `a;k=,`, `!a`, `a=1`, `"a";r=0;t=30;`, "a\n", `a,b,`,
	} {
		_, ok := parseSFList(in)
		require.False(t, ok, "%q", in)
	}
}

// header returns the response header of the given fields, a name then its
// values, each value one field line.
func header(fields ...string) http.Header {
	h := http.Header{}
	name := ""
	for _, f := range fields {
		if f == rateLimitHeader || f == rateLimitPolicyHeader || f == "Retry-After" {
			name = f
			continue
		}
		h.Add(name, f)
	}
	return h
}

func TestRateLimitWait(t *testing.T) {
	const rl, pol = rateLimitHeader, rateLimitPolicyHeader
	for _, tc := range []struct {
		name string
		h    http.Header
		want time.Duration
		ok   bool
	}{
		{"spent: wait t", header(rl, `"default";r=0;t=30`), 30 * time.Second, true},
		{"spent, no wait", header(rl, `"default";r=0;t=0`), 0, true},
		{"quota left", header(rl, `"default";r=50;t=30`), 0, false},
		{"no field", header(), 0, false},
		{"the longest spent window",
			header(rl, `"burst";r=0;t=10, "daily";r=0;t=3600`), time.Hour, true},
		{"a quota left is no wait", header(rl, `"burst";r=0;t=10, "daily";r=5;t=3600`), 10 * time.Second, true},
		{"split over field lines", header(rl, `"burst";r=0;t=10`, `"daily";r=0;t=20`), 20 * time.Second, true},
		{"an inner list as a parameter is malformed",
			header(rl, `"default";r=0;t=30;acme-x=?1;y=@1700000000;z=%"caf%c3%a9";w=:AQID:;v=(1 2)`), 0, false},
		{"other parameters, of every bare type",
			header(rl, `"default";r=0;t=30;acme-x=?1;y=@1700000000;z=%"caf%c3%a9";w=:AQID:;v=1.5;u=tok;s="x"`),
			30 * time.Second, true},
		{"a partition key", header(rl, `"peruser";r=0;t=7;pk=:cHsdsRa894==:`), 7 * time.Second, true},
		{"a key given twice has its last value", header(rl, `"d";r=0;t=5;t=9`), 9 * time.Second, true},
		{"a huge window saturates", header(rl, `"d";r=0;t=999999999999999`), maxDuration, true},
		{"the policy's window when RateLimit gives none",
			header(rl, `"permin";r=0`, pol, `"permin";q=50;w=60`), time.Minute, true},
		{"policies over several lines, the last match",
			header(rl, `"permin";r=0`, pol, `"perhr";q=1000;w=3600`, `"permin";q=50;w=60;qu="requests"`),
			time.Minute, true},
		{"RateLimit's own window first", header(rl, `"permin";r=0;t=5`, pol, `"permin";q=50;w=60`), 5 * time.Second, true},
		{"a policy of another name", header(rl, `"permin";r=0`, pol, `"perhr";q=1000;w=3600`), 0, false},
		{"a policy of another partition", header(rl, `"p";r=0;pk=:AQ==:`, pol, `"p";q=1;w=60;pk=:Ag==:`), 0, false},
		{"a policy without a partition for a limit with one",
			header(rl, `"p";r=0;pk=:AQ==:`, pol, `"p";q=1;w=60`), 0, false},
		{"the same partition", header(rl, `"p";r=0;pk=:AQ==:`, pol, `"p";q=1;w=60;pk=:AQ:`), time.Minute, true},
		{"a policy without a window", header(rl, `"p";r=0`, pol, `"p";q=1`), 0, false},
		{"a malformed policy gives no window", header(rl, `"p";r=0`, pol, `"p";q=1;w=0`), 0, false},
		{"nor does a policy whose q is missing", header(rl, `"p";r=0`, pol, `"p";w=60`), 0, false},
		{"nor one whose unit is a token", header(rl, `"p";r=0`, pol, `"p";q=1;w=60;qu=requests`), 0, false},
		{"a malformed policy leaves RateLimit's own window", header(rl, `"p";r=0;t=3`, pol, `p;q=1;w=60`),
			3 * time.Second, true},
		// Malformed RateLimit fields are ignored as a whole.
		{"a negative r", header(rl, `"default";r=-1;t=30`), 0, false},
		{"a negative t", header(rl, `"default";r=0;t=-30`), 0, false},
		{"no r", header(rl, `"default";t=30`), 0, false},
		{"a decimal t", header(rl, `"default";r=0;t=1.5`), 0, false},
		{"a string t", header(rl, `"default";r=0;t="30"`), 0, false},
		{"a decimal r", header(rl, `"default";r=0.0;t=30`), 0, false},
		{"a token for the policy", header(rl, `default;r=0;t=30`), 0, false},
		{"an inner list", header(rl, `("a" "b");r=0;t=30`), 0, false},
		{"a token partition key", header(rl, `"default";r=0;t=30;pk=abc`), 0, false},
		{"a trailing comma", header(rl, `"default";r=0;t=30,`), 0, false},
		{"an upper-case key", header(rl, `"default";R=0;t=30`), 0, false},
		{"one bad member spoils the field", header(rl, `"a";r=0;t=30, "b";r=x`), 0, false},
		{"one bad field line spoils the field", header(rl, `"a";r=0;t=30`, `"b`), 0, false},
		{"not a structured field", header(rl, `limit=100, remaining=0, reset=30`), 0, false},
		{"an empty field", header(rl, ``), 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := rateLimitWait(tc.h)
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
}

// RateLimit speaks on a 429 or a 503 only, and Retry-After takes
// precedence over it.
func TestClassifyRateLimit(t *testing.T) {
	spent := `"default";r=0;t=30`
	with := func(code int, fields ...string) *http.Response {
		return &http.Response{StatusCode: code, Header: header(fields...)}
	}
	for _, tc := range []struct {
		name string
		resp *http.Response
		code string
		want Decision
	}{
		{"429", with(429, rateLimitHeader, spent),
			"", Decision{Retry: true, Class: "status_429", Throttle: true, RetryAfter: 30 * time.Second, HasRetryAfter: true}},
		{"503", with(503, rateLimitHeader, spent),
			"", Decision{Retry: true, Class: "status_503", Throttle: true, RetryAfter: 30 * time.Second, HasRetryAfter: true}},
		{"503, quota left", with(503, rateLimitHeader, `"default";r=1;t=30`), "", Decision{Retry: true, Class: "status_503"}},
		{"503, spent with no wait", with(503, rateLimitHeader, `"default";r=0;t=0`),
			"", Decision{Retry: true, Class: "status_503", HasRetryAfter: true}},
		{"Retry-After first", with(429, rateLimitHeader, spent, "Retry-After", "3"),
			"", Decision{Retry: true, Class: "status_429", Throttle: true, RetryAfter: 3 * time.Second, HasRetryAfter: true}},
		{"Retry-After: 0 first", with(503, rateLimitHeader, spent, "Retry-After", "0"),
			"", Decision{Retry: true, Class: "status_503", HasRetryAfter: true}},
		{"a malformed Retry-After is none", with(503, rateLimitHeader, spent, "Retry-After", "soon"),
			"", Decision{Retry: true, Class: "status_503", Throttle: true, RetryAfter: 30 * time.Second, HasRetryAfter: true}},
		{"a malformed RateLimit is none", with(503, rateLimitHeader, `"default";r=0;t=30s`),
			"", Decision{Retry: true, Class: "status_503"}},
		{"502", with(502, rateLimitHeader, spent), "", Decision{Retry: true, Class: "status_502"}},
		{"the in-progress 409", with(409, rateLimitHeader, spent), problemInProgress,
			Decision{Retry: true, Class: ClassInProgress, Throttle: true}},
		{"200", with(200, rateLimitHeader, spent), "", Decision{Class: ClassOK}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, Classify(nil, Input{Idempotent: true, Response: tc.resp, ProblemCode: tc.code}, now))
		})
	}
}

// A 503 asking for no wait is no throttling: "Retry-After: 0" or a date in
// the past is a transient failure, as a 503 with no header is.
func TestClassify503WithoutWaitIsNoThrottle(t *testing.T) {
	for _, v := range []string{"0", "000", now.Add(-time.Hour).Format(http.TimeFormat), now.Format(http.TimeFormat)} {
		d := Classify(nil, Input{Idempotent: true, Response: resp(503, "Retry-After", v)}, now)
		require.Equal(t, Decision{Retry: true, Class: "status_503", HasRetryAfter: true}, d, "Retry-After: %s", v)
	}
	d := Classify(nil, Input{Idempotent: true, Response: resp(503, "Retry-After", "1")}, now)
	require.True(t, d.Throttle, "a wait above 0 is throttling")
	d = Classify(nil, Input{Idempotent: true, Response: resp(429, "Retry-After", "0")}, now)
	require.True(t, d.Throttle, "a 429 is throttling, whatever it asks")
}

// sfSerialize writes members back as a List (RFC 9651 section 4.1).
func sfSerialize(members []sfMember) string {
	var b strings.Builder
	for i, m := range members {
		if i > 0 {
			b.WriteString(", ")
		}
		if m.inner {
			b.WriteByte('(')
			for j, it := range m.list {
				if j > 0 {
					b.WriteByte(' ')
				}
				b.WriteString(sfBare(it))
			}
			b.WriteByte(')')
		} else {
			b.WriteString(sfBare(m.item))
		}
		for _, p := range m.params {
			b.WriteString(";" + p.key)
			if p.val != (sfItem{kind: sfBoolean, num: 1}) {
				b.WriteString("=" + sfBare(p.val))
			}
		}
	}
	return b.String()
}

func sfBare(it sfItem) string {
	switch it.kind {
	case sfInteger:
		return strconv.FormatInt(it.num, 10)
	case sfDecimal:
		sign := ""
		if it.num < 0 || it.milli < 0 {
			sign = "-"
		}
		return fmt.Sprintf("%s%d.%03d", sign, abs(it.num), abs(it.milli))
	case sfString:
		return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(it.str) + `"`
	case sfToken:
		return it.str
	case sfBytes:
		return ":" + base64.StdEncoding.EncodeToString([]byte(it.str)) + ":"
	case sfBoolean:
		return "?" + strconv.FormatInt(it.num, 10)
	case sfDate:
		return "@" + strconv.FormatInt(it.num, 10)
	case sfDisplay:
		var b strings.Builder
		b.WriteString(`%"`)
		for i := 0; i < len(it.str); i++ {
			c := it.str[i]
			if c == '%' || c == '"' || c < 0x20 || c > 0x7e {
				fmt.Fprintf(&b, "%%%02x", c)
			} else {
				b.WriteByte(c)
			}
		}
		b.WriteByte('"')
		return b.String()
	}
	panic("unknown kind")
}

func abs(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

// FuzzRateLimit: the parser never panics; a List it accepts, written back,
// parses to the same members; a wait it finds is never negative and comes
// from a valid RateLimit field with a spent quota.
func FuzzRateLimit(f *testing.F) {
	for _, s := range [][2]string{
		{`"default";r=0;t=30`, ``},
		{`"permin";r=0`, `"permin";q=50;w=60`},
		{`"burst";r=0;t=10, "daily";r=5;t=3600`, `"burst";q=100;w=60,"daily";q=1000;w=86400`},
		{`"peruser";r=0;t=7;pk=:cHsdsRa894==:`, `"peruser";q=65535;qu="content-bytes";w=10;pk=:cHsdsRa894==:`},
		{`abc;a=1;b=2; cde_456, (ghi;jk=4 l);q="9";r=w`, `?1, @12, %"%c3%bc", -1.5`},
		{`"d";r=0;t=999999999999999`, `"d";q=0`},
		{`"a \"q\" \\";r=0;t=1, ()`, `:YQ=:`},
	} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, limit, policy string) {
		for _, in := range []string{limit, policy} {
			members, ok := parseSFList(in)
			if !ok {
				continue
			}
			out := sfSerialize(members)
			again, ok := parseSFList(out)
			if !ok {
				t.Fatalf("%q parsed, its serialisation %q does not", in, out)
			}
			if fmt.Sprint(again) != fmt.Sprint(members) {
				t.Fatalf("%q: %v, written back %q: %v", in, members, out, again)
			}
		}
		h := http.Header{rateLimitHeader: {limit}, rateLimitPolicyHeader: {policy}}
		wait, ok := rateLimitWait(h)
		if wait < 0 || (!ok && wait != 0) {
			t.Fatalf("rateLimitWait(%q, %q) = %v, %v", limit, policy, wait, ok)
		}
		if ok {
			limits, valid := parseRateLimits([]string{limit}, "r", "t", 0)
			spent := false
			for _, l := range limits {
				spent = spent || l.quota == 0
			}
			if !valid || !spent {
				t.Fatalf("rateLimitWait(%q, %q) = %v from no spent quota", limit, policy, wait)
			}
		}
		d := Classify(nil, Input{Idempotent: true, Response: &http.Response{StatusCode: 503, Header: h}}, now)
		if d.HasRetryAfter != ok || d.RetryAfter != wait || d.Throttle != (ok && wait > 0) {
			t.Fatalf("Classify of a 503 with %q, %q: %+v, want wait %v, %v", limit, policy, d, wait, ok)
		}
	})
}
