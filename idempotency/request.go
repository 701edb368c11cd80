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

func (s storedRequest) encode() []byte {
	meta, _ := json.Marshal(s) // strings only: cannot fail
	// encoding/json escapes every control character in a string, so the
	// JSON holds no raw newline: the first one ends it.
	b := make([]byte, 0, len(meta)+1+len(s.Body))
	return append(append(append(b, meta...), '\n'), s.Body...)
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

var errTooLarge = errors.New("idempotency: request body too large")

// readBody reads r's body, at most limit bytes: errTooLarge beyond.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	limit = min(limit, math.MaxInt64-1)
	b, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errTooLarge
	}
	return b, nil
}
