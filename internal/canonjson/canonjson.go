// Package canonjson computes the canonical form of a JSON value (object keys
// sorted, no insignificant whitespace, numbers as written, strings as
// encoding/json writes them without HTML escaping), refusing input that it
// could not canonicalise without merging two different values. The
// idempotency fingerprint hashes JSON bodies in this form.
//
// It gives the same bytes, and refuses the same inputs, as the short
// encoding/json version its tests keep as the oracle (decode into interface
// values with UseNumber, check for ambiguity, re-encode without HTML
// escaping), with Parser.FoldKeys on or off; it exists for its cost, which
// every guarded request pays. On a 553-byte payment body (BenchmarkParser,
// BenchmarkReference, FoldKeys on) it takes about 2 us and no allocation
// against 45 us and 516 allocations: the short
// version alone would cost twice the rest of a guarded request on the
// memory store (about 20 us, 55 allocations, bench BenchmarkMiddleware) and
// a sixth of one on SQLite (0.29 ms).
package canonjson

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"slices"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// ErrNotJSON is returned (wrapped) by Canonical for input that is not
// exactly one valid JSON value.
var ErrNotJSON = errors.New("canonjson: not a single JSON value")

// ErrAmbiguousJSON is returned (wrapped) by Canonical for valid JSON
// that it cannot canonicalise without merging different bodies: a string
// with invalid UTF-8 or a lone surrogate escape ("\ud800" and "\udfff"
// would both decode to U+FFFD), or an object that repeats a key
// ({"amount":1,"amount":1000} would equal {"amount":1000}; with
// Parser.FoldKeys, a key equal to another under case folding). The
// idempotency fingerprint hashes such a body raw.
var ErrAmbiguousJSON = errors.New(
	"canonjson: JSON with invalid UTF-8, a lone surrogate escape or a repeated key")

// Canonical returns the canonical form of the JSON value in b: object
// keys sorted (by their UTF-8 bytes, as encoding/json sorts map keys), no
// insignificant whitespace, numbers kept as their literal text (1.0 and 1
// stay different), strings re-encoded by encoding/json without HTML
// escaping ("\u00e9" and "é" are the same string). It is idempotent:
// Canonical of its own output returns that output.
//
// It never maps two different JSON values to one form: input it cannot
// canonicalise without loss (invalid UTF-8, a lone surrogate escape, an
// object with a repeated key) returns an error wrapping ErrAmbiguousJSON,
// and input that is not exactly one JSON value (optionally surrounded by
// whitespace) an error wrapping ErrNotJSON. Safe for concurrent use; never
// panics.
func Canonical(b []byte) ([]byte, error) {
	var p Parser
	return p.Append(make([]byte, 0, len(b)), b)
}

// Append appends the canonical form of b to out (see Canonical), reusing
// p's buffers, and returns the extended slice. A Parser is used by one
// goroutine at a time; its zero value is ready to use.
func (p *Parser) Append(out, b []byte) ([]byte, error) {
	p.in, p.pos = b, 0
	p.scratch, p.nodes, p.order = p.scratch[:0], p.nodes[:0], p.order[:0]
	p.skipSpace()
	root, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.skipSpace()
	if p.pos != len(p.in) {
		return nil, fmt.Errorf("%w: data after the value at byte %d", ErrNotJSON, p.pos)
	}
	return p.emit(out, root)
}

// Large reports whether p holds buffers of more than limit bytes: a caller
// that pools Parsers drops those rather than keep one huge input's memory.
func (p *Parser) Large(limit int) bool {
	const jnodeSize = 64
	return cap(p.scratch) > limit || cap(p.nodes)*jnodeSize > limit || cap(p.order)*8 > limit
}

// Release lets go of the last input, so that a pooled Parser does not keep
// it alive.
func (p *Parser) Release() { p.in = nil }

// maxJSONDepth bounds nesting, as encoding/json does.
const maxJSONDepth = 10000

// Parser canonicalises JSON without reflection or interface values (the
// idempotency fingerprint runs on every guarded request) in two passes:
// parse builds a tree of jnodes over the input, then emit writes each value
// once, sorting each object's members as it goes, so the work is O(n log n)
// however deep the nesting. Its zero value is ready to use; a Parser is
// used by one goroutine at a time and keeps its buffers between calls.
type Parser struct {
	// FoldKeys makes object members whose names are equal under Unicode
	// case folding (bytes.EqualFold: "amount" and "AMOUNT") repeated keys,
	// refused as ambiguous: encoding/json matches a member to a struct
	// field that way, the last one winning, so {"amount":1,"AMOUNT":1000}
	// decodes as 1000 and its reordering as 1. Canonical leaves it off.
	FoldKeys bool

	in      []byte
	pos     int
	scratch []byte  // decoded strings and keys
	nodes   []jnode // the tree; children are linked through next
	order   []int   // emit's stack of member indices being sorted
}

// jnode is one JSON value. Indices, not pointers: nodes grows while parsing.
type jnode struct {
	kind             byte // '{', '[', '"' (string), '0' (number), 'l' (true, false, null)
	start, end       int  // '"': decoded bytes in scratch; '0', 'l': literal text in the input
	keyStart, keyEnd int  // a member of an object: its decoded key in scratch
	first, last      int  // '{', '[': first and last child, -1 when empty
	next             int  // the next sibling, -1 for the last
}

func (p *Parser) notJSON(what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrNotJSON, what, p.pos)
}

func (p *Parser) skipSpace() {
	for p.pos < len(p.in) {
		switch p.in[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *Parser) newNode(kind byte, start, end int) int {
	p.nodes = append(p.nodes,
		jnode{kind: kind, start: start, end: end, first: -1, last: -1, next: -1})
	return len(p.nodes) - 1
}

// link appends child to the children of container.
func (p *Parser) link(container, child int) {
	if last := p.nodes[container].last; last >= 0 {
		p.nodes[last].next = child
	} else {
		p.nodes[container].first = child
	}
	p.nodes[container].last = child
}

func (p *Parser) value(depth int) (int, error) {
	if p.pos >= len(p.in) {
		return 0, p.notJSON("unexpected end")
	}
	switch c := p.in[p.pos]; {
	case (c == '{' || c == '[') && depth >= maxJSONDepth:
		// The root container is nesting level 1, as in encoding/json.
		return 0, p.notJSON("nesting too deep")
	case c == '{':
		return p.object(depth)
	case c == '[':
		return p.array(depth)
	case c == '"':
		start := len(p.scratch)
		if err := p.str(); err != nil {
			return 0, err
		}
		return p.newNode('"', start, len(p.scratch)), nil
	case c == '-' || ('0' <= c && c <= '9'):
		start := p.pos
		if err := p.number(); err != nil {
			return 0, err
		}
		return p.newNode('0', start, p.pos), nil
	default:
		for _, lit := range [...]string{"true", "false", "null"} {
			if bytes.HasPrefix(p.in[p.pos:], []byte(lit)) {
				p.pos += len(lit)
				return p.newNode('l', p.pos-len(lit), p.pos), nil
			}
		}
		return 0, p.notJSON("invalid character")
	}
}

func (p *Parser) array(depth int) (int, error) {
	p.pos++ // '['
	n := p.newNode('[', 0, 0)
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == ']' {
		p.pos++
		return n, nil
	}
	for {
		p.skipSpace()
		child, err := p.value(depth + 1)
		if err != nil {
			return 0, err
		}
		p.link(n, child)
		p.skipSpace()
		if p.pos >= len(p.in) {
			return 0, p.notJSON("unexpected end in array")
		}
		switch p.in[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			return n, nil
		default:
			return 0, p.notJSON("expected , or ] in array")
		}
	}
}

func (p *Parser) object(depth int) (int, error) {
	p.pos++ // '{'
	n := p.newNode('{', 0, 0)
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == '}' {
		p.pos++
		return n, nil
	}
	for {
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != '"' {
			return 0, p.notJSON("expected a key")
		}
		keyStart := len(p.scratch)
		if err := p.str(); err != nil {
			return 0, err
		}
		keyEnd := len(p.scratch)
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != ':' {
			return 0, p.notJSON("expected : after a key")
		}
		p.pos++
		p.skipSpace()
		child, err := p.value(depth + 1)
		if err != nil {
			return 0, err
		}
		p.nodes[child].keyStart, p.nodes[child].keyEnd = keyStart, keyEnd
		p.link(n, child)
		p.skipSpace()
		if p.pos >= len(p.in) {
			return 0, p.notJSON("unexpected end in object")
		}
		switch p.in[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			return n, nil
		default:
			return 0, p.notJSON("expected , or } in object")
		}
	}
}

func (p *Parser) key(i int) []byte {
	return p.scratch[p.nodes[i].keyStart:p.nodes[i].keyEnd]
}

// emit appends the canonical form of node i to out.
func (p *Parser) emit(out []byte, i int) ([]byte, error) {
	nd := p.nodes[i]
	switch nd.kind {
	case '"':
		return appendJSONString(out, p.scratch[nd.start:nd.end]), nil
	case '0', 'l':
		return append(out, p.in[nd.start:nd.end]...), nil
	case '[':
		out = append(out, '[')
		for c := nd.first; c >= 0; c = p.nodes[c].next {
			if c != nd.first {
				out = append(out, ',')
			}
			var err error
			if out, err = p.emit(out, c); err != nil {
				return nil, err
			}
		}
		return append(out, ']'), nil
	}
	// An object: its members sorted by key bytes (as encoding/json sorts
	// map keys); a repeated key is ambiguous.
	base := len(p.order)
	for c := nd.first; c >= 0; c = p.nodes[c].next {
		p.order = append(p.order, c)
	}
	members := p.order[base:]
	if p.FoldKeys && len(members) > 1 {
		slices.SortFunc(members, func(a, b int) int { return compareFold(p.key(a), p.key(b)) })
		for k := 1; k < len(members); k++ {
			if compareFold(p.key(members[k-1]), p.key(members[k])) == 0 {
				return nil, fmt.Errorf("%w: keys %q and %q are equal under case folding",
					ErrAmbiguousJSON, p.key(members[k-1]), p.key(members[k]))
			}
		}
	}
	slices.SortStableFunc(members, func(a, b int) int { return bytes.Compare(p.key(a), p.key(b)) })
	for k := 1; k < len(members); k++ {
		if bytes.Equal(p.key(members[k-1]), p.key(members[k])) {
			return nil, fmt.Errorf("%w: repeated key %q", ErrAmbiguousJSON, p.key(members[k]))
		}
	}
	out = append(out, '{')
	for k := base; k < base+len(members); k++ {
		m := p.order[k] // re-read: nested emits grow p.order
		if k > base {
			out = append(out, ',')
		}
		out = appendJSONString(out, p.key(m))
		out = append(out, ':')
		var err error
		if out, err = p.emit(out, m); err != nil {
			return nil, err
		}
	}
	p.order = p.order[:base]
	return append(out, '}'), nil
}

// compareFold orders a and b (valid UTF-8) by their runes folded as
// foldRune folds them: it returns 0 exactly when bytes.EqualFold(a, b).
func compareFold(a, b []byte) int {
	for len(a) > 0 && len(b) > 0 {
		ra, na := rune(a[0]), 1
		if ra >= utf8.RuneSelf {
			ra, na = utf8.DecodeRune(a)
		}
		rb, nb := rune(b[0]), 1
		if rb >= utf8.RuneSelf {
			rb, nb = utf8.DecodeRune(b)
		}
		if ra != rb {
			if c := cmp.Compare(foldRune(ra), foldRune(rb)); c != 0 {
				return c
			}
		}
		a, b = a[na:], b[nb:]
	}
	return cmp.Compare(len(a), len(b))
}

// foldRune returns the smallest rune of r's case-folding orbit
// (unicode.SimpleFold), as encoding/json folds names: two runes fold alike
// exactly when they are equal under simple case folding.
func foldRune(r rune) rune {
	if r < utf8.RuneSelf {
		if 'a' <= r && r <= 'z' {
			return r - 'a' + 'A'
		}
		return r
	}
	for {
		r2 := unicode.SimpleFold(r)
		if r2 <= r {
			return r2
		}
		r = r2
	}
}

// str reads the string at p.pos (its opening quote) and appends its decoded
// bytes to p.scratch. Invalid UTF-8 and lone surrogate escapes are refused as
// ambiguous: decoding would turn them into U+FFFD and merge different bodies.
func (p *Parser) str() error {
	p.pos++ // opening quote
	for {
		if p.pos >= len(p.in) {
			return p.notJSON("unterminated string")
		}
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			return nil
		case c == '\\':
			if err := p.escape(); err != nil {
				return err
			}
		case c < 0x20:
			return p.notJSON("control character in string")
		case c < utf8.RuneSelf:
			p.scratch = append(p.scratch, c)
			p.pos++
		default:
			r, size := utf8.DecodeRune(p.in[p.pos:])
			if r == utf8.RuneError && size == 1 {
				return fmt.Errorf("%w: invalid UTF-8 at byte %d", ErrAmbiguousJSON, p.pos)
			}
			p.scratch = append(p.scratch, p.in[p.pos:p.pos+size]...)
			p.pos += size
		}
	}
}

// escape decodes the escape sequence at p.pos (its backslash).
func (p *Parser) escape() error {
	if p.pos+1 >= len(p.in) {
		return p.notJSON("unterminated escape")
	}
	var b byte
	switch p.in[p.pos+1] {
	case '"', '\\', '/':
		b = p.in[p.pos+1]
	case 'b':
		b = '\b'
	case 'f':
		b = '\f'
	case 'n':
		b = '\n'
	case 'r':
		b = '\r'
	case 't':
		b = '\t'
	case 'u':
		r := hex4(p.in, p.pos+2)
		if r < 0 {
			return p.notJSON(`invalid \u escape`)
		}
		size := 6
		switch {
		case r >= 0xD800 && r <= 0xDBFF:
			lo := -1
			if p.pos+7 < len(p.in) && p.in[p.pos+6] == '\\' && p.in[p.pos+7] == 'u' {
				lo = hex4(p.in, p.pos+8)
			}
			if lo < 0xDC00 || lo > 0xDFFF {
				return fmt.Errorf("%w: lone surrogate escape at byte %d", ErrAmbiguousJSON, p.pos)
			}
			r = int(utf16.DecodeRune(rune(r), rune(lo)))
			size = 12
		case r >= 0xDC00 && r <= 0xDFFF:
			return fmt.Errorf("%w: lone surrogate escape at byte %d", ErrAmbiguousJSON, p.pos)
		}
		p.scratch = utf8.AppendRune(p.scratch, rune(r))
		p.pos += size
		return nil
	default:
		return p.notJSON("invalid escape")
	}
	p.scratch = append(p.scratch, b)
	p.pos += 2
	return nil
}

// hex4 returns the value of the four hex digits at b[i:], or -1.
func hex4(b []byte, i int) int {
	if i < 0 || i+4 > len(b) {
		return -1
	}
	v := 0
	for _, c := range b[i : i+4] {
		switch {
		case '0' <= c && c <= '9':
			v = v<<4 | int(c-'0')
		case 'a' <= c && c <= 'f':
			v = v<<4 | int(c-'a'+10)
		case 'A' <= c && c <= 'F':
			v = v<<4 | int(c-'A'+10)
		default:
			return -1
		}
	}
	return v
}

// number reads the number at p.pos, checked against the JSON grammar; its
// literal text is kept as it is.
func (p *Parser) number() error {
	digits := func() int {
		n := 0
		for p.pos < len(p.in) && '0' <= p.in[p.pos] && p.in[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	if p.in[p.pos] == '-' {
		p.pos++
	}
	switch {
	case p.pos < len(p.in) && p.in[p.pos] == '0':
		p.pos++
	case digits() == 0:
		return p.notJSON("invalid number")
	}
	if p.pos < len(p.in) && p.in[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return p.notJSON("invalid number")
		}
	}
	if p.pos < len(p.in) && (p.in[p.pos] == 'e' || p.in[p.pos] == 'E') {
		p.pos++
		if p.pos < len(p.in) && (p.in[p.pos] == '+' || p.in[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return p.notJSON("invalid number")
		}
	}
	return nil
}

// appendJSONString appends s (valid UTF-8) as a JSON string exactly as
// encoding/json writes it with HTML escaping off: '"' and '\' escaped, the
// control characters as \b \f \n \r \t or \u00XX, U+2028 and U+2029 as
// \u2028 and \u2029, everything else verbatim.
func appendJSONString(dst, s []byte) []byte {
	const hexDigits = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRune(s[i:])
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
