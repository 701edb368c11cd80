package retry

import (
	"encoding/base64"
	"strconv"
	"strings"
	"unicode/utf8"
)

// A parser of RFC 9651 (Structured Field Values for HTTP) Lists, which the
// RateLimit and RateLimit-Policy fields are. It follows the RFC's parsing
// algorithms (section 4.2) step by step and fails on anything they refuse,
// so that a malformed field is ignored as a whole: every bare item type is
// parsed (a parameter the library does not read may hold any of them),
// inner lists included. Its work is linear in the field's length, which
// net/http has already bounded.

// sfKind is the type of a bare item.
type sfKind byte

const (
	sfInteger sfKind = iota + 1
	sfDecimal
	sfString
	sfToken
	sfBytes
	sfBoolean
	sfDate
	sfDisplay
)

// sfItem is a bare item. Integers and dates are in num; decimals in num
// and milli (thousandths, with num's sign); strings, tokens, display
// strings and decoded byte sequences in str; booleans in num (0 or 1).
type sfItem struct {
	kind  sfKind
	num   int64
	milli int64
	str   string
}

// sfParam is one parameter; a key without a value is the boolean true.
type sfParam struct {
	key string
	val sfItem
}

// sfMember is a List member: an item, or an inner list (inner is true and
// the items are in list), with its parameters.
type sfMember struct {
	item   sfItem
	inner  bool
	list   []sfItem
	params []sfParam
}

// param returns the value of the parameter key, and whether it is there.
// A key given twice has its last value (the RFC overwrites).
func (m sfMember) param(key string) (sfItem, bool) {
	for i := len(m.params) - 1; i >= 0; i-- {
		if m.params[i].key == key {
			return m.params[i].val, true
		}
	}
	return sfItem{}, false
}

// sfParser holds the input not yet consumed.
type sfParser struct{ s string }

// parseSFList parses s as a List (RFC 9651 section 4.2.1), surrounding
// spaces discarded. It returns false when s is not a valid List; an empty
// s is an empty List.
func parseSFList(s string) ([]sfMember, bool) {
	p := sfParser{s: strings.TrimLeft(s, " ")}
	var members []sfMember
	for p.s != "" {
		m, ok := p.member()
		if !ok {
			return nil, false
		}
		members = append(members, m)
		p.s = strings.TrimLeft(p.s, " \t")
		if p.s == "" {
			break
		}
		if p.s[0] != ',' {
			return nil, false
		}
		p.s = strings.TrimLeft(p.s[1:], " \t")
		if p.s == "" {
			return nil, false // a trailing comma
		}
	}
	// The RFC discards leading spaces only; the field's own trailing spaces
	// are OWS, which the List's last member leaves in p.s and the loop trims.
	return members, true
}

// member parses an item or an inner list, with its parameters.
func (p *sfParser) member() (sfMember, bool) {
	var m sfMember
	if p.s != "" && p.s[0] == '(' {
		p.s = p.s[1:]
		for {
			p.s = strings.TrimLeft(p.s, " ")
			if p.s == "" {
				return m, false
			}
			if p.s[0] == ')' {
				p.s = p.s[1:]
				break
			}
			it, ok := p.item()
			if !ok {
				return m, false
			}
			m.list = append(m.list, it)
			if p.s == "" || (p.s[0] != ' ' && p.s[0] != ')') {
				return m, false
			}
		}
		m.inner = true
	} else {
		it, ok := p.bareItem()
		if !ok {
			return m, false
		}
		m.item = it
	}
	params, ok := p.params()
	m.params = params
	return m, ok
}

// item parses an item of an inner list: a bare item and its parameters,
// which no field the library reads gives meaning to.
func (p *sfParser) item() (sfItem, bool) {
	it, ok := p.bareItem()
	if !ok {
		return it, false
	}
	_, ok = p.params()
	return it, ok
}

// params parses parameters (RFC 9651 section 4.2.3.2).
func (p *sfParser) params() ([]sfParam, bool) {
	var params []sfParam
	for p.s != "" && p.s[0] == ';' {
		p.s = strings.TrimLeft(p.s[1:], " ")
		key, ok := p.key()
		if !ok {
			return nil, false
		}
		val := sfItem{kind: sfBoolean, num: 1}
		if p.s != "" && p.s[0] == '=' {
			p.s = p.s[1:]
			if val, ok = p.bareItem(); !ok {
				return nil, false
			}
		}
		params = append(params, sfParam{key: key, val: val})
	}
	return params, true
}

// key parses a key: lcalpha or "*", then lcalpha, DIGIT, "_", "-", ".", "*".
func (p *sfParser) key() (string, bool) {
	if p.s == "" || !(isLower(p.s[0]) || p.s[0] == '*') {
		return "", false
	}
	n := 1
	for n < len(p.s) {
		c := p.s[n]
		if !(isLower(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*') {
			break
		}
		n++
	}
	key := p.s[:n]
	p.s = p.s[n:]
	return key, true
}

// bareItem parses a bare item (RFC 9651 section 4.2.3.1).
func (p *sfParser) bareItem() (sfItem, bool) {
	if p.s == "" {
		return sfItem{}, false
	}
	switch c := p.s[0]; {
	case c == '-' || isDigit(c):
		return p.number()
	case c == '"':
		return p.str()
	case c == '*' || isAlpha(c):
		return p.token(), true
	case c == ':':
		return p.bytes()
	case c == '?':
		return p.boolean()
	case c == '@':
		p.s = p.s[1:]
		it, ok := p.number()
		if !ok || it.kind != sfInteger {
			return sfItem{}, false
		}
		it.kind = sfDate
		return it, true
	case c == '%':
		return p.display()
	}
	return sfItem{}, false
}

// number parses an Integer (at most 15 digits) or a Decimal (at most 12
// integer digits and 1 to 3 fraction digits), RFC 9651 section 4.2.4.
func (p *sfParser) number() (sfItem, bool) {
	neg := false
	if p.s != "" && p.s[0] == '-' {
		neg, p.s = true, p.s[1:]
	}
	if p.s == "" || !isDigit(p.s[0]) {
		return sfItem{}, false
	}
	n, dot := 0, -1
	for ; n < len(p.s); n++ {
		c := p.s[n]
		if c == '.' && dot < 0 {
			if n > 12 {
				return sfItem{}, false
			}
			dot = n
			continue
		}
		if !isDigit(c) {
			break
		}
		if (dot < 0 && n >= 15) || (dot >= 0 && n >= 16) {
			return sfItem{}, false
		}
	}
	text := p.s[:n]
	p.s = p.s[n:]
	sign := int64(1)
	if neg {
		sign = -1
	}
	if dot < 0 {
		v, _ := strconv.ParseInt(text, 10, 64) // at most 15 digits: never out of range
		return sfItem{kind: sfInteger, num: sign * v}, true
	}
	frac := text[dot+1:]
	if frac == "" || len(frac) > 3 {
		return sfItem{}, false
	}
	whole, _ := strconv.ParseInt(text[:dot], 10, 64)
	milli, _ := strconv.ParseInt((frac + "00")[:3], 10, 64)
	return sfItem{kind: sfDecimal, num: sign * whole, milli: sign * milli}, true
}

// str parses a String: printable ASCII between double quotes, with \" and
// \\ the only escapes.
func (p *sfParser) str() (sfItem, bool) {
	var b strings.Builder
	for i := 1; i < len(p.s); i++ {
		c := p.s[i]
		switch {
		case c == '\\':
			i++
			if i == len(p.s) || (p.s[i] != '"' && p.s[i] != '\\') {
				return sfItem{}, false
			}
			b.WriteByte(p.s[i])
		case c == '"':
			p.s = p.s[i+1:]
			return sfItem{kind: sfString, str: b.String()}, true
		case c < 0x20 || c > 0x7e:
			return sfItem{}, false
		default:
			b.WriteByte(c)
		}
	}
	return sfItem{}, false // no closing quote
}

// token parses a Token: ALPHA or "*", then tchar, ":" or "/". The caller
// has checked the first character.
func (p *sfParser) token() sfItem {
	n := 1
	for n < len(p.s) && (isTchar(p.s[n]) || p.s[n] == ':' || p.s[n] == '/') {
		n++
	}
	it := sfItem{kind: sfToken, str: p.s[:n]}
	p.s = p.s[n:]
	return it
}

// bytes parses a Byte Sequence: base64 between colons, its padding
// optional.
func (p *sfParser) bytes() (sfItem, bool) {
	end := strings.IndexByte(p.s[1:], ':')
	if end < 0 {
		return sfItem{}, false
	}
	b64 := p.s[1 : 1+end]
	for i := 0; i < len(b64); i++ {
		if c := b64[i]; !(isAlpha(c) || isDigit(c) || c == '+' || c == '/' || c == '=') {
			return sfItem{}, false
		}
	}
	// Padding may be left out (the RFC synthesises it), never misplaced or
	// in excess.
	data := strings.TrimRight(b64, "=")
	if pad := len(b64) - len(data); pad > (4-len(data)%4)%4 || strings.IndexByte(data, '=') >= 0 {
		return sfItem{}, false
	}
	raw, err := base64.RawStdEncoding.DecodeString(data)
	if err != nil {
		return sfItem{}, false
	}
	p.s = p.s[2+end:]
	return sfItem{kind: sfBytes, str: string(raw)}, true
}

// boolean parses ?0 or ?1.
func (p *sfParser) boolean() (sfItem, bool) {
	if len(p.s) < 2 || (p.s[1] != '0' && p.s[1] != '1') {
		return sfItem{}, false
	}
	it := sfItem{kind: sfBoolean, num: int64(p.s[1] - '0')}
	p.s = p.s[2:]
	return it, true
}

// display parses a Display String: %"..." of printable ASCII, with
// %-escapes of lower-case hex pairs, that decodes to valid UTF-8.
func (p *sfParser) display() (sfItem, bool) {
	if len(p.s) < 2 || p.s[1] != '"' {
		return sfItem{}, false
	}
	var b []byte
	for i := 2; i < len(p.s); i++ {
		c := p.s[i]
		switch {
		case c < 0x20 || c > 0x7e:
			return sfItem{}, false
		case c == '%':
			if i+2 >= len(p.s) || !isLowerHex(p.s[i+1]) || !isLowerHex(p.s[i+2]) {
				return sfItem{}, false
			}
			v, _ := strconv.ParseUint(p.s[i+1:i+3], 16, 8)
			b = append(b, byte(v))
			i += 2
		case c == '"':
			if !utf8.Valid(b) {
				return sfItem{}, false
			}
			p.s = p.s[i+1:]
			return sfItem{kind: sfDisplay, str: string(b)}, true
		default:
			b = append(b, c)
		}
	}
	return sfItem{}, false
}

func isDigit(c byte) bool    { return c >= '0' && c <= '9' }
func isLower(c byte) bool    { return c >= 'a' && c <= 'z' }
func isAlpha(c byte) bool    { return isLower(c) || (c >= 'A' && c <= 'Z') }
func isLowerHex(c byte) bool { return isDigit(c) || (c >= 'a' && c <= 'f') }

// isTchar reports whether c is a tchar of RFC 9110.
func isTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
