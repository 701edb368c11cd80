package keygen

import "strings"

// ParseHeader reads an idempotency key from the values of its header as
// received (http.Header.Values). It is the one wire rule that the client
// Transport and the server middleware share:
//
//   - The header must come on exactly one field line: two Idempotency-Key
//     field lines are refused ("list"), even when they hold the same
//     value, because a receiver that joins them cannot tell one key from two.
//     Within the one line a comma is part of the key: "invoice,2024-7" sent
//     bare is the key invoice,2024-7, not a list.
//   - The spaces and tabs around the value are trimmed (HTTP's optional
//     whitespace).
//   - A value that starts and ends with '"' (and has at least two bytes) is
//     an RFC 9651 sf-string: the key is its content, in which '"' and '\' are
//     escaped as \" and \\ and every other byte is 0x20..0x7E; anything else
//     is "malformed_string".
//   - Any other value is the key as it is, quotes, backslashes, commas and
//     inner spaces included: "order 42" is the key order 42.
//
// The key must then pass [Validate] (1 to 255 bytes of 0x20..0x7E, no
// outer space). It returns the key, or an *[InvalidKeyError] matching
// [ErrInvalidKey] with the reason "empty" (no value), "list",
// "malformed_string" or a Validate reason. [FormatHeader] writes every
// valid key so that ParseHeader reads it back. Safe for concurrent use;
// never panics.
func ParseHeader(vals []string) (string, error) {
	switch len(vals) {
	case 0:
		return "", newInvalid("", reasonEmpty, -1)
	case 1:
	default:
		return "", newInvalid(strings.Join(vals, ", "), reasonList, -1)
	}
	v := strings.Trim(vals[0], " \t")
	if isSFString(v) {
		s, ok := parseSFString(v)
		if !ok {
			return "", newInvalid(vals[0], reasonMalformedString, -1)
		}
		v = s
	}
	if err := Validate(v); err != nil {
		return "", err
	}
	return v, nil
}

// isSFString reports whether the trimmed header value v is read as an
// sf-string: it starts and ends with '"'.
func isSFString(v string) bool {
	return len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"'
}

// parseSFString parses v, which starts and ends with '"', as a complete RFC
// 9651 sf-string: the closing quote must be the last byte.
func parseSFString(v string) (string, bool) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i >= len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", false
			}
			b.WriteByte(v[i])
		case c == '"':
			return b.String(), i == len(v)-1
		case c < 0x20 || c > 0x7E:
			return "", false
		default:
			b.WriteByte(c)
		}
	}
	return "", false
}

// FormatHeader returns key as a header value that [ParseHeader] reads back
// as key, for every key that passes [Validate]: the key itself (inner
// spaces included) when it contains no '"', ',' or '\', otherwise an RFC
// 9651 sf-string with '"' and '\' escaped, which also keeps a comma from
// being taken for a list separator by intermediaries that treat the header
// as a list. It does not validate key. Keys from [Random] and [Event] never
// need quoting. Safe for concurrent use.
func FormatHeader(key string) string {
	if !strings.ContainsAny(key, `",\`) {
		return key
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(key) + `"`
}
