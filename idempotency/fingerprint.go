package idempotency

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"mime"
	"net/url"
	"strings"
	"sync"

	"github.com/saferetry/saferetry/internal/canonjson"
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
//     is hashed in canonical form: object keys sorted by their UTF-8 bytes,
//     no insignificant whitespace, numbers kept as their literal text (1.0
//     and 1 stay different), strings re-encoded by encoding/json without
//     HTML escaping ("\u00e9" and "é" are the same string). A body that is
//     not valid JSON, or that has no unambiguous canonical form (invalid
//     UTF-8, a lone surrogate escape, a repeated key), is hashed raw: its retries
//     must send the same bytes. A raw hash can only make two equal bodies
//     differ (a false CodeKeyReused, safe), never two different bodies
//     match.
//
// Safe for concurrent use; never fails.
func Fingerprint(method, route, path, rawQuery, contentType string, body []byte) string {
	st := fpStates.Get().(*fpState)
	defer st.put()
	st.field([]byte{FingerprintVersion})
	st.fieldString(strings.ToUpper(method))
	st.fieldString(route)
	st.fieldString(path)
	st.fieldString(canonicalQuery(rawQuery))
	mt := mediaType(contentType)
	st.fieldString(mt)
	if isJSON(mt) {
		if c, err := st.parser.Append(st.out[:0], body); err == nil {
			st.out = c
			body = c
		}
	}
	st.field(body)
	st.sum = st.h.Sum(st.sum[:0])
	var hx [2 * sha256.Size]byte
	hex.Encode(hx[:], st.sum)
	return string(hx[:])
}

// fpState is the reusable state of one Fingerprint call: a fingerprint is
// computed on every guarded request, and with its digest, buffers and
// parser reused it costs one allocation (the returned string).
type fpState struct {
	h      hash.Hash
	n      [8]byte
	tmp    []byte // a string field's bytes
	out    []byte // the canonical JSON body
	sum    []byte
	parser canonjson.Parser
}

var fpStates = sync.Pool{New: func() any { return &fpState{h: sha256.New()} }}

// maxPooledBuffer bounds the buffers a pooled fpState keeps: one huge body
// must not pin its memory for ever.
const maxPooledBuffer = 64 << 10

func (st *fpState) field(b []byte) {
	binary.BigEndian.PutUint64(st.n[:], uint64(len(b)))
	st.h.Write(st.n[:])
	st.h.Write(b)
}

func (st *fpState) fieldString(s string) {
	st.tmp = append(st.tmp[:0], s...)
	st.field(st.tmp)
}

func (st *fpState) put() {
	st.h.Reset()
	if cap(st.tmp) > maxPooledBuffer || cap(st.out) > maxPooledBuffer || st.parser.Large(maxPooledBuffer) {
		return // let the collector have it
	}
	st.parser.Release() // do not pin the request's body
	fpStates.Put(st)
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
	if !strings.Contains(ct, ";") {
		// No parameters: the result below whether ParseMediaType accepts
		// ct or not, without building its parameter map.
		return strings.ToLower(strings.TrimSpace(ct))
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
