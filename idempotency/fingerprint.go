package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/url"
	"strings"
	"unicode/utf8"
)

// FingerprintVersion is the version of the Fingerprint algorithm. The
// middleware stores it in every record (Record.FingerprintVersion); a record
// whose version differs from the running one is treated as a different
// request (a key reuse), never replayed for a request it cannot be compared
// with.
const FingerprintVersion = 1

// Fingerprint returns the hex SHA-256 of the canonical form of a request:
// FingerprintVersion, method, route, path, the canonical query, the media
// type and the canonical body, each length-prefixed so that no two
// different inputs share an encoding.
//
//   - route is the guarded route (the ServeMux pattern, say "POST /orders/{id}");
//     path is the escaped request path, so that two requests matching one
//     pattern with different path values ("/orders/1", "/orders/2") differ.
//   - The query is parsed and re-encoded with keys sorted (the order of the
//     values of one key is kept); a query that does not parse is hashed raw.
//   - contentType is reduced to its media type, lower-cased, without
//     parameters (a charset parameter does not change the fingerprint).
//   - For a JSON media type (application/json or any "+json" type) the body
//     is hashed in the form CanonicalJSON returns; a body that is not valid
//     JSON, or that CanonicalJSON refuses as ambiguous (invalid UTF-8, a
//     lone surrogate escape, a repeated key), is hashed raw: its retries
//     must send the same bytes. A raw hash can only make two equal bodies
//     differ (a false CodeKeyReused, safe), never two different bodies
//     match.
//
// Safe for concurrent use; never fails.
func Fingerprint(method, route, path, rawQuery, contentType string, body []byte) string {
	h := sha256.New()
	field := func(b []byte) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	field([]byte{FingerprintVersion})
	field([]byte(strings.ToUpper(method)))
	field([]byte(route))
	field([]byte(path))
	field([]byte(canonicalQuery(rawQuery)))
	mt := mediaType(contentType)
	field([]byte(mt))
	if isJSON(mt) {
		if c, err := CanonicalJSON(body); err == nil {
			body = c
		}
	}
	field(body)
	return hex.EncodeToString(h.Sum(nil))
}

func canonicalQuery(raw string) string {
	if raw == "" {
		return ""
	}
	v, err := url.ParseQuery(raw)
	if err != nil {
		return "raw:" + raw
	}
	return v.Encode() // sorted by key, values in order
}

func mediaType(ct string) string {
	if ct == "" {
		return ""
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		mt, _, _ = strings.Cut(ct, ";")
	}
	return strings.ToLower(strings.TrimSpace(mt))
}

func isJSON(mt string) bool {
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// ErrNotJSON is returned (wrapped) by CanonicalJSON for input that is not
// exactly one valid JSON value.
var ErrNotJSON = errors.New("idempotency: not a single JSON value")

// ErrAmbiguousJSON is returned (wrapped) by CanonicalJSON for valid JSON
// that it cannot canonicalise without merging different bodies: a string
// with invalid UTF-8 or a lone surrogate escape ("\ud800" and "\udfff"
// would both decode to U+FFFD), or an object that repeats a key
// ({"amount":1,"amount":1000} would equal {"amount":1000}). Fingerprint
// hashes such a body raw.
var ErrAmbiguousJSON = errors.New("idempotency: JSON with invalid UTF-8, a lone surrogate escape or a repeated key")

// CanonicalJSON returns the canonical form of the JSON value in b: object
// keys sorted (by their UTF-8 bytes, as encoding/json sorts map keys), no
// insignificant whitespace, numbers kept as their literal text (1.0 and 1
// stay different), strings re-encoded by encoding/json without HTML
// escaping ("\u00e9" and "é" are the same string). It is idempotent:
// CanonicalJSON of its own output returns that output.
//
// It never maps two different JSON values to one form: input it cannot
// canonicalise without loss (invalid UTF-8, a lone surrogate escape, an
// object with a repeated key) returns an error wrapping ErrAmbiguousJSON,
// and input that is not exactly one JSON value (optionally surrounded by
// whitespace) an error wrapping ErrNotJSON. Safe for concurrent use; never
// panics.
func CanonicalJSON(b []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ErrNotJSON
	}
	// b is one valid JSON value: refuse what the decoding above lost.
	if !utf8.Valid(b) {
		return nil, fmt.Errorf("%w: invalid UTF-8", ErrAmbiguousJSON)
	}
	if err := checkSurrogates(b); err != nil {
		return nil, err
	}
	if err := checkRepeatedKeys(b); err != nil {
		return nil, err
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	return bytes.TrimSuffix(out.Bytes(), []byte("\n")), nil
}

// checkSurrogates reports a \u escape of a UTF-16 surrogate that is not
// part of a high-low pair, in b, a valid JSON value.
func checkSurrogates(b []byte) error {
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
							i += 11 // the pair
							continue
						}
					}
					return fmt.Errorf("%w: lone surrogate escape at byte %d", ErrAmbiguousJSON, i)
				case r >= 0xDC00 && r <= 0xDFFF:
					return fmt.Errorf("%w: lone surrogate escape at byte %d", ErrAmbiguousJSON, i)
				}
				i += 5
			} else {
				i++ // a one-character escape
			}
		}
	}
	return nil
}

// hex4 returns the value of the four hex digits at b[i:], or -1.
func hex4(b []byte, i int) int {
	if i+4 > len(b) {
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

// checkRepeatedKeys reports an object of b (a valid JSON value without
// invalid UTF-8 or lone surrogates, so that decoded keys are exact) that
// repeats a key.
func checkRepeatedKeys(b []byte) error {
	type frame struct {
		keys      map[string]bool // nil for an array
		expectKey bool
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return errors.Join(ErrNotJSON, err)
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				if top != nil && top.keys != nil {
					top.expectKey = true // a value: a key comes next
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
			top.expectKey = true // a value: a key comes next
			continue
		}
		key, _ := tok.(string)
		if top.keys[key] {
			return fmt.Errorf("%w: repeated key %q", ErrAmbiguousJSON, key)
		}
		top.keys[key] = true
		top.expectKey = false
	}
}
