package canonjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// referenceCanonicalJSON is the first implementation of Canonical, built on
// encoding/json (decode into interface values, re-encode without HTML
// escaping) plus the ambiguity checks. The single-pass canonicaliser must give
// the same bytes for every body this one accepts, and refuse every body it
// refuses: the idempotency FingerprintVersion did not change when it was
// replaced. fold is Parser.FoldKeys.
func referenceCanonical(b []byte, fold bool) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ErrNotJSON
	}
	if !utf8.Valid(b) || refLoneSurrogate(b) || refRepeatedKey(b, fold) {
		return nil, ErrAmbiguousJSON
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	return bytes.TrimSuffix(out.Bytes(), []byte("\n")), nil
}

func refLoneSurrogate(b []byte) bool {
	inString := false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case !inString:
			inString = c == '"'
		case c == '"':
			inString = false
		case c == '\\':
			if i+1 < len(b) && b[i+1] == 'u' {
				r := hex4(b, i+2)
				switch {
				case r >= 0xD800 && r <= 0xDBFF:
					if i+11 < len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
						if lo := hex4(b, i+8); lo >= 0xDC00 && lo <= 0xDFFF {
							i += 11
							continue
						}
					}
					return true
				case r >= 0xDC00 && r <= 0xDFFF:
					return true
				}
				i += 5
			} else {
				i++
			}
		}
	}
	return false
}

// refRepeatedKey reports whether an object of b repeats a key, or with
// fold has two keys that bytes.EqualFold finds equal.
func refRepeatedKey(b []byte, fold bool) bool {
	type frame struct {
		keys      map[string]bool
		expectKey bool
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				if top != nil && top.keys != nil {
					top.expectKey = true
				}
				f := &frame{}
				if d == '{' {
					f.keys, f.expectKey = map[string]bool{}, true
				}
				stack = append(stack, f)
			default:
				stack = stack[:len(stack)-1]
			}
			continue
		}
		if top == nil || top.keys == nil {
			continue
		}
		if !top.expectKey {
			top.expectKey = true
			continue
		}
		key, _ := tok.(string)
		if top.keys[key] {
			return true
		}
		for k := range top.keys {
			if fold && bytes.EqualFold([]byte(k), []byte(key)) {
				return true
			}
		}
		top.keys[key] = true
		top.expectKey = false
	}
}

var canonicalSeeds = []string{
	`{"b":1,"a":[1,2,{"z":null,"y":true}],"c":"x"}`,
	` { "amount" : 1000 , "currency" : "EUR" } `,
	`{"amount":1,"amount":1000}`,
	`"\ud800"`, `"\udfff"`, `"\ud83d\ude00"`, "\"\xff\"", `"\u00e9"`, `"é"`,
	`"<&>\u2028\u2029\b\f\n\r\t\u0001\u007f\/"`,
	`[1.0, 1, -0, 0.5e10, 1E+2, -12.5e-3]`, `01`, `1.`, `-`, `.5`, `1e`, `[1,]`, `{"a":1,}`, `{"a"}`,
	`{} {}`, `[]`, `{}`, `null`, `true`, `false`, `nul`, `"unterminated`, `"\x"`, `"\u12"`,
	`{"a":{"a":{"a":1}},"A":2,"é":3,"e":4}`, `{"\u0061":1,"a":2}`,
	`{"amount":1,"AMOUNT":1000}`, `{"x":{"Id":1,"iD":2}}`, `{"K":1,"\u212a":2}`, `{"ſ":1,"S":2}`, `{"é":1,"É":2}`,
	`{"ss":1,"ß":2}`, `{"a":1,"b":2,"A":3}`,
}

func TestCanonicalMatchesTheReference(t *testing.T) {
	for _, s := range canonicalSeeds {
		compareWithReference(t, []byte(s))
	}
	for _, n := range []int{maxJSONDepth - 1, maxJSONDepth, maxJSONDepth + 1} {
		compareWithReference(t, []byte(strings.Repeat("[", n)+strings.Repeat("]", n)))
		compareWithReference(t, []byte(strings.Repeat("[", n-1)+"{}"+strings.Repeat("]", n-1)))
		compareWithReference(t, []byte(strings.Repeat(`{"a":`, n)+"1"+strings.Repeat("}", n)))
	}
}

func FuzzCanonicalMatchesTheReference(f *testing.F) {
	for _, s := range canonicalSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		timer := time.AfterFunc(3*time.Second, func() { panic(fmt.Sprintf("slow input %q", b)) })
		defer timer.Stop()
		compareWithReference(t, b)
	})
}

func compareWithReference(t *testing.T, b []byte) {
	t.Helper()
	for _, fold := range []bool{false, true} {
		p := Parser{FoldKeys: fold}
		got, err := p.Append(nil, b)
		want, rerr := referenceCanonical(b, fold)
		if (err == nil) != (rerr == nil) {
			t.Fatalf("Canonical(%q) with FoldKeys %v: error %v, reference error %v", b, fold, err, rerr)
		}
		if err == nil && !bytes.Equal(got, want) {
			t.Fatalf("Canonical(%q) with FoldKeys %v = %q, reference %q", b, fold, got, want)
		}
	}
}
