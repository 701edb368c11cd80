package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
)

// storedRequest is what the middleware saves in Record.Request when it
// creates a record, so that the Completer can resume an abandoned execution
// without its client: no header but the content type, so no credential
// reaches the store. Its encoding is the JSON of every field but the body,
// a newline, then the body's own bytes (not base64: a third smaller, and no
// encoding work for the largest part).
type storedRequest struct {
	Method      string `json:"method"`
	URL         string `json:"url"` // the request URI: escaped path and query
	Host        string `json:"host,omitempty"`
	ContentType string `json:"content_type,omitempty"`
	Body        []byte `json:"-"` // after the JSON and its newline
}

// encode returns the encoding in one allocation: the JSON is written by
// hand in the field order and form of encoding/json (appendJSONString).
func (s storedRequest) encode() []byte {
	n := len(`{"method":"","url":"","host":"","content_type":""}`) + 1 + len(s.Method) +
		len(s.URL) + len(s.Host) + len(s.ContentType) + len(s.Body)
	b := make([]byte, 0, n)
	b = appendJSONString(append(b, `{"method":`...), s.Method)
	b = appendJSONString(append(b, `,"url":`...), s.URL)
	if s.Host != "" {
		b = appendJSONString(append(b, `,"host":`...), s.Host)
	}
	if s.ContentType != "" {
		b = appendJSONString(append(b, `,"content_type":`...), s.ContentType)
	}
	// encoding/json escapes every control character in a string, so the
	// JSON holds no raw newline: the first one ends it.
	return append(append(b, "}\n"...), s.Body...)
}

// appendJSONString appends v as encoding/json writes a string: as it is
// between quotes when every byte is printable ASCII that it does not
// escape, else as json.Marshal writes it.
func appendJSONString(b []byte, v string) []byte {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' ||
			c == '&' {
			q, _ := json.Marshal(v) // a string: cannot fail
			return append(b, q...)
		}
	}
	return append(append(append(b, '"'), v...), '"')
}

var errBadStoredRequest = errors.New("idempotency: malformed stored request")

// decodeRequest reads an encoded storedRequest: errBadStoredRequest, with
// the cause, for JSON that is not a storedRequest's or no newline after it.
func decodeRequest(b []byte) (storedRequest, error) {
	meta, body, ok := bytes.Cut(b, []byte{'\n'})
	var s storedRequest
	if err := json.Unmarshal(meta, &s); err != nil {
		return storedRequest{}, errors.Join(errBadStoredRequest, err)
	}
	if !ok {
		return storedRequest{}, fmt.Errorf("%w: no newline after the JSON", errBadStoredRequest)
	}
	s.Body = body
	return s, nil
}

// maxPresizedBody bounds what a declared Content-Length reserves before the
// body arrives, for a client that declares more than it sends.
const maxPresizedBody = 64 << 10

var errTooLarge = errors.New("idempotency: request body too large")

// readBody reads r's body, at most limit bytes: errTooLarge beyond. The
// buffer is sized by the declared length (up to the limit and
// maxPresizedBody), so that a body that declares its length is read into
// one allocation; a wrong one only costs growth.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	limit = min(limit, math.MaxInt64-1)
	size := int64(512)
	if cl := r.ContentLength; cl >= 0 && cl < min(limit, maxPresizedBody) {
		size = cl + 1 // room for the EOF to be read without growing
	}
	b := make([]byte, 0, size)
	lr := io.LimitedReader{R: r.Body, N: limit + 1}
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := lr.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if int64(len(b)) > limit {
		return nil, errTooLarge
	}
	return b, nil
}
