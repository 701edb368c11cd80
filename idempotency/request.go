package idempotency

import (
	"io"
	"math"
	"net/http"

	"crypto/rand"
	"encoding/base64"
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

// Encode returns the JSON encoding of s (the format of Record.Request),
// byte for byte what encoding/json.Marshal returns for it, in one allocation
// for the common case of strings that need no escaping.
func (s StoredRequest) Encode() []byte {
	n := len(`{"id":"","method":"","url":"","host":"","content_type":"","body":""}`) +
		len(s.ID) + len(s.Method) + len(s.URL) + len(s.Host) + len(s.ContentType) +
		base64.StdEncoding.EncodedLen(len(s.Body))
	b := make([]byte, 0, n)
	b = append(b, '{')
	if s.ID != "" {
		b = appendStoredString(append(b, `"id":`...), s.ID)
		b = append(b, ',')
	}
	b = appendStoredString(append(b, `"method":`...), s.Method)
	b = appendStoredString(append(b, `,"url":`...), s.URL)
	if s.Host != "" {
		b = appendStoredString(append(b, `,"host":`...), s.Host)
	}
	if s.ContentType != "" {
		b = appendStoredString(append(b, `,"content_type":`...), s.ContentType)
	}
	if len(s.Body) > 0 {
		b = append(b, `,"body":"`...)
		b = base64.StdEncoding.AppendEncode(b, s.Body)
		b = append(b, '"')
	}
	return append(b, '}')
}

// appendStoredString appends v as encoding/json.Marshal encodes a string: directly
// when it is printable ASCII that needs no escape (HTML-escaped characters
// included), through encoding/json otherwise.
func appendStoredString(b []byte, v string) []byte {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			enc, _ := json.Marshal(v) // cannot fail for a string
			return append(b, enc...)
		}
	}
	b = append(b, '"')
	b = append(b, v...)
	return append(b, '"')
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

var errTooLarge = errors.New("idempotency: request body too large")

func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	// Sized by the declared length when there is one (one byte more, so
	// that reading the end needs no second buffer), as io.ReadAll otherwise;
	// never more than 64 KiB before the bytes arrive, whatever a client
	// declares.
	limit = min(limit, math.MaxInt64-1) // limit+1 below must not overflow
	size := int64(512)
	if n := r.ContentLength; n >= 0 && n <= limit {
		size = min(n+1, 64<<10)
	}
	b, err := readAll(r.Body, make([]byte, 0, size), limit+1)
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errTooLarge
	}
	return b, nil
}

// readAll is io.ReadAll appending to b, reading no more than limit bytes in
// all (as through an io.LimitedReader).
func readAll(r io.Reader, b []byte, limit int64) ([]byte, error) {
	for {
		if int64(len(b)) >= limit {
			return b, nil
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // let append grow the buffer
		}
		n, err := r.Read(b[len(b):min(int64(cap(b)), limit)])
		b = b[:len(b)+n]
		if err != nil {
			if err == io.EOF {
				err = nil
			}
			return b, err
		}
	}
}
