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

// fingerprintVersion is the version of the fingerprint algorithm new records
// store (Record.FingerprintVersion). Version 1 dropped the content type's
// parameters and canonicalised a JSON object whose member names differ only
// in case; version 2 keeps the parameters (a multipart boundary or a
// charset changes what the body means) and hashes such a JSON body raw
// (encoding/json matches names without regard to case, so
// {"amount":1,"AMOUNT":1000} and its reordering mean different amounts). A
// record of another version is compared with the fingerprint of that
// version, if the middleware knows it, and is otherwise a different
// request.
const fingerprintVersion = 2

// fingerprintInput is what a request's fingerprint covers.
type fingerprintInput struct {
	method, route, path, rawQuery, contentType string
	body                                       []byte
}

// fingerprint returns the hex SHA-256 of the canonical form of in under
// algorithm version v, and false for a version it does not know. The form
// is v, the upper-case method, the route, the escaped path, the query
// re-encoded with its keys sorted (raw if it does not parse), the content
// type and the body, each length-prefixed. The content type is its media
// type, lower-cased, with (version 2) its parameters as mime.FormatMediaType
// writes them, or the raw value when it does not parse. A JSON body
// (application/json, any +json type) is in canonical form (canonjson; in
// version 2 with FoldKeys), or raw when it has none: a raw hash can make
// two equal bodies differ (a false CodeKeyReused), never two different
// bodies match.
func fingerprint(in fingerprintInput, v int) (string, bool) {
	if v != 1 && v != 2 {
		return "", false
	}
	st := fpStates.Get().(*fpState)
	defer st.put()
	st.field([]byte{byte(v)})
	st.fieldString(strings.ToUpper(in.method))
	st.fieldString(in.route)
	st.fieldString(in.path)
	st.fieldString(canonicalQuery(in.rawQuery))
	mt, ct := contentType(in.contentType)
	if v == 1 {
		st.fieldString(mt)
	} else {
		st.fieldString(ct)
	}
	body := in.body
	if mt == "application/json" || strings.HasSuffix(mt, "+json") {
		st.parser.FoldKeys = v >= 2
		if c, err := st.parser.Append(st.out[:0], body); err == nil {
			st.out = c
			body = c
		}
	}
	st.field(body)
	st.sum = st.h.Sum(st.sum[:0])
	return hex.EncodeToString(st.sum), true
}

// fpState is the reusable state of one fingerprint: a digest, buffers and a
// JSON parser, pooled since every guarded request computes one.
type fpState struct {
	h      hash.Hash
	n      [8]byte
	tmp    []byte
	out    []byte
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
	if cap(st.tmp) > maxPooledBuffer || cap(st.out) > maxPooledBuffer ||
		st.parser.Large(maxPooledBuffer) {
		return
	}
	st.parser.Release()
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

// contentType returns the media type of ct, lower-cased, and ct's canonical
// form with its parameters (mime.FormatMediaType), or "raw:" and ct when it
// does not parse.
func contentType(ct string) (mediaType, full string) {
	if ct == "" {
		return "", ""
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil {
		mt, _, _ = strings.Cut(ct, ";")
		return strings.ToLower(strings.TrimSpace(mt)), "raw:" + ct
	}
	if full = mime.FormatMediaType(mt, params); full == "" {
		full = "raw:" + ct
	}
	return strings.ToLower(strings.TrimSpace(mt)), full
}
