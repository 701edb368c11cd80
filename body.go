package saferetry

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"mime"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/retry"
)

// prepareBody makes the request body replayable: GetBody when the caller gave
// one, otherwise a buffer of up to the configured limit.
func (c *call) prepareBody() error {
	req := c.req
	if req.Body == nil || req.Body == http.NoBody {
		return nil
	}
	c.body = req.Body
	if req.GetBody != nil {
		c.getBody = req.GetBody
		return nil
	}
	if c.maxAttempts == 1 {
		return nil // nothing to replay: send the body as it is
	}
	limit := min(c.t.cfg.maxBufferedBody, math.MaxInt64-1) // limit+1 must not overflow
	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		return fmt.Errorf("saferetry: reading request body: %w", err)
	}
	if int64(len(buf)) > limit {
		// Too large to buffer: send it once, as a stream, and never retry.
		c.body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}
		c.notRetrying = retry.ReasonBodyNotRewindable // logged before the first attempt
		return nil
	}
	req.Body.Close()
	c.body = io.NopCloser(bytes.NewReader(buf))
	c.getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	return nil
}

// cloneHeader copies h's map, sharing its value slices (never appended
// to), with room for the headers the Transport adds of its own.
func cloneHeader(h http.Header) http.Header {
	c := make(http.Header, len(h)+3)
	maps.Copy(c, h)
	return c
}

// maxProblemPeek bounds how much of a 409 body is read to find its code.
const maxProblemPeek = 4 << 10

// maxPeekTime bounds, in time, the read of a 409's problem code: the
// middleware writes that short body with its headers, so a second is ample,
// and a stalled one does not hold the loop until the overall deadline.
const maxPeekTime = time.Second

// peekProblemCode reads the "code" member of an application/problem+json 409
// without consuming the body for the caller: the bytes read are put back.
// The read is bounded in bytes here, and in time by the attempt's context,
// which its time limit or maxPeekTime ends.
func peekProblemCode(resp *http.Response) string {
	if resp.Body == nil {
		return ""
	}
	mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if err != nil || mt != "application/problem+json" {
		return ""
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxProblemPeek))
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(buf), errReader{err}, resp.Body), resp.Body}
	if err != nil {
		return ""
	}
	return problemCode(buf)
}

// errReader replays a read error met while peeking, in its place.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	return 0, io.EOF
}

// problemCode extracts the "code" member of a problem+json document.
func problemCode(body []byte) string {
	var p struct {
		Code string `json:"code"`
	}
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	return p.Code
}
