package idempotency

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
)

// StoredRequest is the request the middleware saves in Record.Request when it
// claims a key, so that a background completer can resume an abandoned
// execution without the client. It holds no headers except the content type:
// credentials never reach the store.
type StoredRequest struct {
	// ID identifies the logical request: random, minted by the middleware
	// at the claim, kept by every takeover of the record, new when the key
	// is reused after the replay window. Run.DownstreamKey derives from it.
	ID          string `json:"id,omitempty"`
	Method      string `json:"method"`
	URL         string `json:"url"` // the request URI: escaped path and query
	Host        string `json:"host,omitempty"`
	ContentType string `json:"content_type,omitempty"`
	Body        []byte `json:"body,omitempty"`
}

// ErrBadRequestRecord is returned (wrapped) by DecodeRequest for bytes that
// are not an encoded StoredRequest.
var ErrBadRequestRecord = errors.New("idempotency: malformed stored request")

// Encode returns the JSON encoding of s (the format of Record.Request).
func (s StoredRequest) Encode() []byte {
	b, _ := json.Marshal(s) // cannot fail: strings and bytes only
	return b
}

// DecodeRequest decodes what StoredRequest.Encode produced. Errors wrap
// ErrBadRequestRecord.
func DecodeRequest(b []byte) (StoredRequest, error) {
	var s StoredRequest
	if err := json.Unmarshal(b, &s); err != nil {
		return StoredRequest{}, errors.Join(ErrBadRequestRecord, err)
	}
	return s, nil
}

// newExecID returns a StoredRequest.ID: 64 random bits in hex.
func newExecID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand panics instead, on a broken system)
	return hex.EncodeToString(b[:])
}
