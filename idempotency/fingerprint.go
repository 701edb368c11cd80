package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/url"
	"strings"
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
//     JSON is hashed raw.
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

// CanonicalJSON returns the canonical form of the JSON value in b: object
// keys sorted (by their UTF-8 bytes, as encoding/json sorts map keys), no
// insignificant whitespace, numbers kept as their literal text (1.0 and 1
// stay different), strings re-encoded by encoding/json without HTML
// escaping (invalid UTF-8 becomes U+FFFD). When an object repeats a key,
// the last value wins. It is idempotent: CanonicalJSON of its own output
// returns that output. Input that is not exactly one JSON value (optionally
// surrounded by whitespace) returns an error wrapping ErrNotJSON. Safe for
// concurrent use; never panics.
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
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, errors.Join(ErrNotJSON, err)
	}
	return bytes.TrimSuffix(out.Bytes(), []byte("\n")), nil
}
