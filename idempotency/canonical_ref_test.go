package idempotency

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// referenceCanonicalJSON is the first implementation of CanonicalJSON, built
// on encoding/json (decode into interface values, re-encode without HTML
// escaping) plus the ambiguity checks. The single-pass canonicaliser must give
// the same bytes for every body this one accepts, and refuse every body it
// refuses: FingerprintVersion did not change when it was replaced.
func referenceCanonicalJSON(b []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ErrNotJSON
	}
	if !utf8.Valid(b) || refLoneSurrogate(b) || refRepeatedKey(b) {
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

func refRepeatedKey(b []byte) bool {
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
}

func TestCanonicalJSONMatchesTheReference(t *testing.T) {
	for _, s := range canonicalSeeds {
		compareWithReference(t, []byte(s))
	}
	for _, n := range []int{maxJSONDepth - 1, maxJSONDepth, maxJSONDepth + 1} {
		compareWithReference(t, []byte(strings.Repeat("[", n)+strings.Repeat("]", n)))
		compareWithReference(t, []byte(strings.Repeat("[", n-1)+"{}"+strings.Repeat("]", n-1)))
		compareWithReference(t, []byte(strings.Repeat(`{"a":`, n)+"1"+strings.Repeat("}", n)))
	}
}

func FuzzCanonicalJSONMatchesTheReference(f *testing.F) {
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
	got, err := CanonicalJSON(b)
	want, rerr := referenceCanonicalJSON(b)
	if (err == nil) != (rerr == nil) {
		t.Fatalf("CanonicalJSON(%q): error %v, reference error %v", b, err, rerr)
	}
	if err == nil && !bytes.Equal(got, want) {
		t.Fatalf("CanonicalJSON(%q) = %q, reference %q", b, got, want)
	}
}

// mediaTypeRef is mediaType as it was before its fast path for values
// without parameters.
func mediaTypeRef(ct string) string {
	if ct == "" {
		return ""
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		mt, _, _ = strings.Cut(ct, ";")
	}
	return strings.ToLower(strings.TrimSpace(mt))
}

func FuzzMediaTypeMatchesTheReference(f *testing.F) {
	for _, s := range []string{"application/json", " Application/JSON ", "text/plain; charset=utf-8", "json",
		"a/b/c", "\xff/x", "x/y\u0085", "bad type", `a/b"c`, "İ/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ct string) {
		if got, want := mediaType(ct), mediaTypeRef(ct); got != want {
			t.Fatalf("mediaType(%q) = %q, the reference says %q", ct, got, want)
		}
	})
}

func TestNewOwnerIsARandomUUIDv4(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		s := newOwner()
		u, err := uuid.Parse(s)
		if err != nil || u.Version() != 4 || u.Variant() != uuid.RFC4122 || u.String() != s {
			t.Fatalf("newOwner() = %q: not a canonical UUIDv4 (%v)", s, err)
		}
		if seen[s] {
			t.Fatalf("newOwner() repeated %q", s)
		}
		seen[s] = true
	}
}

// The largest limit there is still reads the body: limit+1 must not
// overflow into a limit that reads nothing.
func TestMaxRequestBodyOfMaxInt64ReadsTheBody(t *testing.T) {
	const body = `{"amount_cents":1999}`
	var got []byte
	h := New(NewMemoryStore(), WithMaxRequestBody(math.MaxInt64))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
	}))
	r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
	r.Header.Set("Idempotency-Key", "k-maxint")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated || string(got) != body {
		t.Fatalf("status %d, the handler read %q; want 201 and %q", w.Code, got, body)
	}
}

// newIDs gives what newOwner and newExecID give, from one string: a
// canonical UUIDv4 and 16 lower-case hex digits, never repeated.
func TestNewIDsAreARandomUUIDv4AndAnExecID(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		owner, id := newIDs()
		u, err := uuid.Parse(owner)
		if err != nil || u.Version() != 4 || u.Variant() != uuid.RFC4122 || u.String() != owner {
			t.Fatalf("newIDs() owner = %q: not a canonical UUIDv4 (%v)", owner, err)
		}
		if b, err := hex.DecodeString(id); err != nil || len(b) != 8 || hex.EncodeToString(b) != id {
			t.Fatalf("newIDs() execID = %q: not 16 lower-case hex digits", id)
		}
		if seen[owner] || seen[id] {
			t.Fatalf("newIDs() repeated %q or %q", owner, id)
		}
		seen[owner], seen[id] = true, true
	}
}

// readBody reads the whole body whatever its declared length says, and
// refuses one over the limit.
func TestReadBodyIgnoresAWrongContentLength(t *testing.T) {
	body := strings.Repeat("x", 1500)
	for _, declared := range []int64{-1, 0, 1, 700, 1500, 4000} {
		r, err := http.NewRequest(http.MethodPost, "http://x/", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		r.ContentLength = declared
		got, err := readBody(r, 2000)
		if err != nil || string(got) != body {
			t.Fatalf("declared %d: read %d bytes, %v", declared, len(got), err)
		}
		r.Body = io.NopCloser(strings.NewReader(body))
		if _, err := readBody(r, 1499); !errors.Is(err, errTooLarge) {
			t.Fatalf("declared %d: a body over the limit gave %v", declared, err)
		}
	}
}
