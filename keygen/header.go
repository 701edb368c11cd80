package keygen

import "strings"

// ParseHeader reads an idempotency key from the values of its header as
// received (http.Header.Values). It is the one wire rule that the client
// Transport and the server middleware share: exactly one field line holding
// either a bare value (printable ASCII without '"' and ',') or an RFC 9651
// sf-string ("..." with only \" and \\ escapes), optionally surrounded by
// spaces or tabs; the unquoted key must then pass [Validate]. It returns the
// unquoted key, or an *[InvalidKeyError] matching [ErrInvalidKey] with
// ReasonEmpty (no value), ReasonList (two field lines, or a comma list),
// ReasonMalformedString, ReasonQuote, or a Validate reason. Safe for
// concurrent use; never panics.
func ParseHeader(vals []string) (string, error) {
	switch len(vals) {
	case 0:
		return "", newInvalid("", ReasonEmpty, -1)
	case 1:
	default:
		return "", newInvalid(strings.Join(vals, ", "), ReasonList, -1)
	}
	raw := vals[0]
	v := strings.Trim(raw, " \t")
	if strings.HasPrefix(v, `"`) {
		s, ok := parseSFString(v)
		if !ok {
			if strings.Contains(v, ",") {
				return "", newInvalid(raw, ReasonList, -1)
			}
			return "", newInvalid(raw, ReasonMalformedString, -1)
		}
		v = s
	} else {
		if strings.Contains(v, ",") {
			return "", newInvalid(raw, ReasonList, -1)
		}
		if strings.Contains(v, `"`) {
			return "", newInvalid(raw, ReasonQuote, strings.IndexByte(raw, '"'))
		}
	}
	if err := Validate(v); err != nil {
		return "", err
	}
	return v, nil
}

// parseSFString parses v, which starts with '"', as a complete RFC 9651
// sf-string: the closing quote must be the last byte.
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

// FormatHeader returns key as a header value that [ParseHeader] reads back:
// the key itself when it contains no '"', ',' or '\', otherwise an RFC 9651
// sf-string with '"' and '\' escaped. It does not validate key. Keys from
// [Random] and [Event] never need quoting.
func FormatHeader(key string) string {
	if !strings.ContainsAny(key, `",\`) {
		return key
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(key) + `"`
}
