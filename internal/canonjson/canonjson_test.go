package canonjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestCanonical(t *testing.T) {
	for in, want := range map[string]string{
		`{"b":1,"a":[true,null,{"d":"x","c":1.50}]}`: `{"a":[true,null,{"c":1.50,"d":"x"}],"b":1}`,
		" \n{ \"a\" : 1e3 }\t":                       `{"a":1e3}`,
		`"<&>"`:                                      `"<&>"`,
		`-0`:                                         `-0`,
		`"\u00e9\/\ud83d\ude00"`:                     `"é/😀"`,
		`{"a":{"a":1},"b":{"a":2}}`:                  `{"a":{"a":1},"b":{"a":2}}`,
		`[{"a":1},{"a":1}]`:                          `[{"a":1},{"a":1}]`,
	} {
		got, err := Canonical([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, want, string(got), in)
	}
	for _, bad := range []string{``, `{`, `{"a":1} {}`, `{"a":1}x`, `[1,]`, `nul`} {
		_, err := Canonical([]byte(bad))
		require.ErrorIs(t, err, ErrNotJSON, bad)
	}
	// Valid JSON that decoding would merge with another body is refused.
	for _, amb := range []string{
		"\"\xff\"", "{\"\xfe\":1}", `"\ud800"`, `"\udfff"`, `"\ud800\ud800"`, `"x\ud83d"`, `"\ude00\ud83d"`,
		`{"amount":1,"amount":1000}`, `[{"a":{"b":1,"b":1}}]`, `{"a":[],"a":[]}`,
	} {
		_, err := Canonical([]byte(amb))
		require.ErrorIs(t, err, ErrAmbiguousJSON, amb)
	}
	// With FoldKeys, so are names equal under case folding, which
	// encoding/json matches to one struct field; without, they are two
	// members.
	for _, amb := range []string{
		`{"amount":1,"AMOUNT":1000}`, `{"x":[{"Id":1,"iD":2}]}`, `{"K":1,"\u212a":2}`, `{"ſ":1,"S":2}`,
		`{"é":1,"É":2}`, `{"a":1,"b":2,"A":3}`,
	} {
		p := Parser{FoldKeys: true}
		_, err := p.Append(nil, []byte(amb))
		require.ErrorIs(t, err, ErrAmbiguousJSON, amb)
		_, err = Canonical([]byte(amb))
		require.NoError(t, err, amb)
	}
	p := Parser{FoldKeys: true}
	got, err := p.Append(nil, []byte(`{"ss":1,"ß":2,"a":{"b":1},"B":{"b":2}}`))
	require.NoError(t, err, "ß folds to itself (simple folding), b and B are in two objects")
	require.Equal(t, `{"B":{"b":2},"a":{"b":1},"ss":1,"ß":2}`, string(got))
}

// jsonMeaning is an oracle for FuzzCanonical, independent of
// encoding/json: a lossless description of a JSON value. Strings are their
// exact sequence of code points, with lone surrogate escapes (S+) and
// invalid UTF-8 bytes (B+) kept distinct from U+FFFD; numbers are their
// literal text; objects keep every member, repeated keys included, in a
// sorted order. Two texts have equal meanings exactly when they are the
// same JSON value written differently. It is permissive where
// encoding/json is strict (it is only consulted on texts Canonical
// accepted).
func jsonMeaning(b []byte) (string, bool) {
	p := &meaningParser{b: b}
	m, ok := p.value()
	p.space()
	return m, ok && p.i == len(b)
}

type meaningParser struct {
	b []byte
	i int
}

func (p *meaningParser) space() {
	for p.i < len(p.b) && strings.IndexByte(" \t\r\n", p.b[p.i]) >= 0 {
		p.i++
	}
}

func (p *meaningParser) value() (string, bool) {
	p.space()
	if p.i >= len(p.b) {
		return "", false
	}
	switch c := p.b[p.i]; {
	case c == '{':
		p.i++
		var members []string
		for {
			p.space()
			if len(members) == 0 && p.i < len(p.b) && p.b[p.i] == '}' {
				p.i++
				break
			}
			p.space()
			if p.i >= len(p.b) || p.b[p.i] != '"' {
				return "", false
			}
			k, ok := p.str()
			p.space()
			if !ok || p.i >= len(p.b) || p.b[p.i] != ':' {
				return "", false
			}
			p.i++
			v, ok := p.value()
			if !ok {
				return "", false
			}
			members = append(members, k+":"+v)
			p.space()
			if p.i < len(p.b) && p.b[p.i] == ',' {
				p.i++
				continue
			}
			if p.i < len(p.b) && p.b[p.i] == '}' {
				p.i++
				break
			}
			return "", false
		}
		slices.Sort(members)
		return "{" + strings.Join(members, ",") + "}", true
	case c == '[':
		p.i++
		var elems []string
		for {
			p.space()
			if len(elems) == 0 && p.i < len(p.b) && p.b[p.i] == ']' {
				p.i++
				break
			}
			v, ok := p.value()
			if !ok {
				return "", false
			}
			elems = append(elems, v)
			p.space()
			if p.i < len(p.b) && p.b[p.i] == ',' {
				p.i++
				continue
			}
			if p.i < len(p.b) && p.b[p.i] == ']' {
				p.i++
				break
			}
			return "", false
		}
		return "[" + strings.Join(elems, ",") + "]", true
	case c == '"':
		return p.str()
	default:
		start := p.i
		for p.i < len(p.b) && strings.IndexByte("+-.0123456789eEtrufalsn", p.b[p.i]) >= 0 {
			p.i++
		}
		if p.i == start {
			return "", false
		}
		return "N" + string(p.b[start:p.i]) + ";", true
	}
}

// str reads a string literal at p.i as the list of its code points.
func (p *meaningParser) str() (string, bool) {
	p.i++ // the opening quote
	var out strings.Builder
	out.WriteByte('"')
	hex := func(at int) (rune, bool) {
		if at+4 > len(p.b) {
			return 0, false
		}
		v, err := strconv.ParseUint(string(p.b[at:at+4]), 16, 32)
		return rune(v), err == nil
	}
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			p.i++
			out.WriteByte('"')
			return out.String(), true
		case c == '\\':
			if p.i+1 >= len(p.b) {
				return "", false
			}
			e := p.b[p.i+1]
			if e != 'u' {
				r, ok := map[byte]rune{'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'}[e]
				if !ok {
					return "", false
				}
				fmt.Fprintf(&out, "U+%X,", r)
				p.i += 2
				continue
			}
			r, ok := hex(p.i + 2)
			if !ok {
				return "", false
			}
			p.i += 6
			if utf16.IsSurrogate(r) && r < 0xDC00 && p.i+1 < len(p.b) && p.b[p.i] == '\\' && p.b[p.i+1] == 'u' {
				if lo, ok := hex(p.i + 2); ok && lo >= 0xDC00 && lo <= 0xDFFF {
					fmt.Fprintf(&out, "U+%X,", utf16.DecodeRune(r, lo))
					p.i += 6
					continue
				}
			}
			if utf16.IsSurrogate(r) {
				fmt.Fprintf(&out, "S+%X,", r)
			} else {
				fmt.Fprintf(&out, "U+%X,", r)
			}
		default:
			r, size := utf8.DecodeRune(p.b[p.i:])
			if r == utf8.RuneError && size == 1 {
				fmt.Fprintf(&out, "B+%X,", c)
			} else {
				fmt.Fprintf(&out, "U+%X,", r)
			}
			p.i += size
		}
	}
	return "", false
}

func TestJSONMeaningOracle(t *testing.T) {
	mean := func(s string) string {
		m, ok := jsonMeaning([]byte(s))
		require.True(t, ok, s)
		return m
	}
	require.Equal(t, mean(`{"b":[1,"\u00e9"],"a":null}`), mean(` { "a" : null , "b" : [ 1 , "é" ] } `))
	require.Equal(t, mean(`"\ud83d\ude00"`), mean(`"😀"`))
	for _, pair := range [][2]string{
		{"\"\xff\"", "\"\xfe\""}, {`"\ud800"`, `"\udfff"`}, {`"\ud800"`, `"\ufffd"`},
		{`{"a":1,"a":2}`, `{"a":2}`}, {`1.0`, `1`}, {`[1,2]`, `[2,1]`},
	} {
		require.NotEqual(t, mean(pair[0]), mean(pair[1]), "%q vs %q", pair[0], pair[1])
	}
}

func FuzzCanonical(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":2}`, `[1, 2.0, "x", null]`, `{"a":{"c":[],"b":{}}}`, `"\u00e9\ud800"`, `1e400`, `{`, "",
		"\"\xff\"", `"\udfff"`, `"\ud83d\ude00\u00e9\\u0041"`, `{"amount":1,"amount":1000}`, `[{"a":1,"b":{"a":1}},{"a":2}]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		c, err := Canonical([]byte(in))
		if err != nil {
			if json.Valid([]byte(in)) && !errors.Is(err, ErrAmbiguousJSON) {
				t.Fatalf("valid JSON %q rejected: %v", in, err)
			}
			return
		}
		if !json.Valid(c) {
			t.Fatalf("canonical form %q of %q is not JSON", c, in)
		}
		// Soundness: the canonical form means exactly what the input meant
		// (jsonMeaning, an oracle that loses nothing). Since the meaning is
		// a function of the text, Canonical(a) == Canonical(b)
		// then implies that a and b are the same JSON value: no two
		// different bodies share a fingerprint.
		mIn, ok := jsonMeaning([]byte(in))
		if !ok {
			t.Fatalf("the oracle cannot read %q, which Canonical accepted", in)
		}
		if mc, _ := jsonMeaning(c); mc != mIn {
			t.Fatalf("canonical form %q of %q changes its meaning:\n in: %s\nout: %s", c, in, mIn, mc)
		}
		again, err := Canonical(c)
		if err != nil || !bytes.Equal(again, c) {
			t.Fatalf("not idempotent: %q -> %q -> %q (%v)", in, c, again, err)
		}
		// Reordering the keys of a top-level object does not change it.
		var m map[string]json.RawMessage
		if json.Unmarshal(c, &m) == nil && len(m) > 1 {
			var buf bytes.Buffer
			buf.WriteByte('{')
			keys := make([]string, 0, len(m))
			for k := range m {
				keys = append(keys, k)
			}
			for i := len(keys) - 1; i >= 0; i-- { // reverse of sorted
				kb, _ := json.Marshal(keys[i])
				buf.Write(kb)
				buf.WriteString(" : ")
				buf.Write(m[keys[i]])
				if i > 0 {
					buf.WriteString(" ,\n")
				}
			}
			buf.WriteByte('}')
			r, err := Canonical(buf.Bytes())
			if err != nil || !bytes.Equal(r, c) {
				t.Fatalf("reordered %q canonicalises to %q, want %q (%v)", buf.Bytes(), r, c, err)
			}
		}
	})
}
