package idempotency

import (
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
)

// storedRequest is what the middleware saves in Record.Request when it
// creates a record, so that the Completer can resume an abandoned execution
// without its client: no header but the content type, so no credential
// reaches the store. Its encoding is JSON (the body in base64).
type storedRequest struct {
	// ID identifies the logical request: minted at the claim that created
	// the record, kept by every takeover, new for a key reused after the
	// replay window. Run.DownstreamKey derives from it.
	ID          string `json:"id,omitempty"`
	Method      string `json:"method"`
	URL         string `json:"url"` // the request URI: escaped path and query
	Host        string `json:"host,omitempty"`
	ContentType string `json:"content_type,omitempty"`
	Body        []byte `json:"body,omitempty"`
}

func (s storedRequest) encode() []byte {
	b, _ := json.Marshal(s) // strings and bytes: cannot fail
	return b
}

var errBadStoredRequest = errors.New("idempotency: malformed stored request")

func decodeRequest(b []byte) (storedRequest, error) {
	var s storedRequest
	if err := json.Unmarshal(b, &s); err != nil {
		return storedRequest{}, errors.Join(errBadStoredRequest, err)
	}
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
