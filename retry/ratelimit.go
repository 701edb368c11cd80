package retry

import (
	"math"
	"net/http"
	"strings"
	"time"
)

// The fields of draft-ietf-httpapi-ratelimit-headers (revision 11): each a
// Structured Field List (RFC 9651) of Items whose value is a String naming
// a quota policy.
//
//	RateLimit: "default";r=0;t=30
//	RateLimit-Policy: "default";q=100;w=60
//
// RateLimit's items carry r, the quota still available (an Integer, 0 or
// more, required), t, the effective window in seconds (an Integer, 0 or
// more) and pk, a partition key (a Byte Sequence). RateLimit-Policy's carry
// q, the quota (an Integer, 0 or more, required), qu, its unit (a String),
// w, the policy's window in seconds (an Integer, 1 or more) and pk. Other
// parameters are comments.
const (
	rateLimitHeader       = "RateLimit"
	rateLimitPolicyHeader = "RateLimit-Policy"
)

// rateLimitWait returns how long the RateLimit fields of h ask the client
// to wait before its next request, and whether they ask at all: the longest
// effective window of a policy whose available quota is 0 (r=0), its t, or
// when it gives none, the window w of the RateLimit-Policy item with the
// same name and partition key. A quota left above 0, or spent with no
// window known, asks nothing. A malformed field (not a valid List, an item
// that is not a String, a parameter missing, of the wrong type or out of
// range) is ignored as a whole, as the draft requires: a malformed
// RateLimit asks nothing, a malformed RateLimit-Policy gives no windows.
// A wait too long for a time.Duration is the largest one (callers cap it).
func rateLimitWait(h http.Header) (time.Duration, bool) {
	limits, ok := parseRateLimits(h.Values(rateLimitHeader), "r", "t", 0)
	if !ok {
		return 0, false
	}
	var policies []rateLimitItem // parsed only when a spent quota needs its window
	policiesParsed := false
	var wait time.Duration
	found := false
	for _, l := range limits {
		if l.quota != 0 {
			continue
		}
		window, ok := l.window, l.hasWindow
		if !ok {
			if !policiesParsed {
				policies, _ = parseRateLimits(h.Values(rateLimitPolicyHeader), "q", "w", 1)
				policiesParsed = true
			}
			window, ok = policyWindow(policies, l)
		}
		if ok {
			wait, found = max(wait, seconds(window)), true
		}
	}
	return wait, found
}

// rateLimitItem is one item of either field: its policy's name, its
// quota (r or q), its window (t or w) and its partition key.
type rateLimitItem struct {
	name         string
	quota        int64
	window       int64
	hasWindow    bool
	partition    string
	hasPartition bool
}

// parseRateLimits parses the field lines of RateLimit (quota "r", window
// "t", windows from 0) or RateLimit-Policy (quota "q", window "w", windows
// from 1), combined into one List; false when the field is absent or
// malformed.
func parseRateLimits(lines []string, quotaKey, windowKey string,
	minWindow int64) ([]rateLimitItem, bool) {
	if len(lines) == 0 {
		return nil, false
	}
	members, ok := parseSFList(strings.Join(lines, ", "))
	if !ok || len(members) == 0 {
		return nil, false
	}
	items := make([]rateLimitItem, 0, len(members))
	for _, m := range members {
		if m.inner || m.item.kind != sfString {
			return nil, false
		}
		it := rateLimitItem{name: m.item.str}
		q, ok := m.param(quotaKey)
		if !ok || q.kind != sfInteger || q.num < 0 {
			return nil, false
		}
		it.quota = q.num
		if w, ok := m.param(windowKey); ok {
			if w.kind != sfInteger || w.num < minWindow {
				return nil, false
			}
			it.window, it.hasWindow = w.num, true
		}
		if pk, ok := m.param("pk"); ok {
			if pk.kind != sfBytes {
				return nil, false
			}
			it.partition, it.hasPartition = pk.str, true
		}
		if quotaKey == "q" {
			if qu, ok := m.param("qu"); ok && qu.kind != sfString {
				return nil, false
			}
		}
		items = append(items, it)
	}
	return items, true
}

// policyWindow returns the window of the policy that limit l belongs to:
// the last policy item with l's name and partition key that has one.
func policyWindow(policies []rateLimitItem, l rateLimitItem) (int64, bool) {
	for i := len(policies) - 1; i >= 0; i-- {
		p := policies[i]
		samePartition := p.hasPartition == l.hasPartition && p.partition == l.partition
		if p.name == l.name && samePartition && p.hasWindow {
			return p.window, true
		}
	}
	return 0, false
}

// seconds returns n seconds (n >= 0) as a duration, saturated.
func seconds(n int64) time.Duration {
	if n > math.MaxInt64/int64(time.Second) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(n) * time.Second
}
