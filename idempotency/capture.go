package idempotency

import (
	"bufio"
	"bytes"
	"errors"
	"net"
	"net/http"
)

// ErrHijackGuarded is the error with which the response writer of a guarded
// request refuses to hijack its connection (http.Hijacker, or
// http.ResponseController.Hijack): the middleware stores what the handler
// answers through the writer and sends it only once the record is
// committed, so bytes written to a hijacked connection could never be
// replayed. The handler may answer over HTTP after the refusal as usual. To
// upgrade a connection (WebSocket, say), serve that route without the
// middleware.
var ErrHijackGuarded = errors.New("idempotency: the connection of a guarded request cannot be hijacked")

// capture buffers a handler's whole response so that the record commits
// before the client sees any of it. It implements http.Flusher, but a Flush
// is deferred until the response is released after the commit: a guarded
// handler cannot stream. Unwrap exposes the underlying writer to
// http.ResponseController (deadlines); Hijack always fails with
// ErrHijackGuarded, so that http.ResponseController never reaches the
// underlying writer's.
type capture struct {
	w           http.ResponseWriter
	header      http.Header
	status      int
	wroteHeader bool
	body        bytes.Buffer
	flushed     bool
}

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(code int) {
	if c.wroteHeader {
		return
	}
	if code >= 100 && code < 200 {
		// 1xx informational responses are dropped: nothing reaches the
		// client before the commit.
		return
	}
	if code < 100 || code > 999 {
		// net/http would panic; the response becomes a 500 instead.
		code = http.StatusInternalServerError
	}
	c.status, c.wroteHeader = code, true
}

func (c *capture) Write(p []byte) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	return c.body.Write(p)
}

// Flush records the request to flush; the flush happens after the commit.
func (c *capture) Flush() { c.flushed = true }

// Hijack refuses: it returns ErrHijackGuarded.
func (c *capture) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, ErrHijackGuarded }

// Unwrap returns the underlying http.ResponseWriter.
func (c *capture) Unwrap() http.ResponseWriter { return c.w }

func (c *capture) statusCode() int {
	if !c.wroteHeader {
		return http.StatusOK
	}
	return c.status
}

// release sends the buffered response to the client.
func (c *capture) release() {
	dst := c.w.Header()
	for k, v := range c.header {
		dst[k] = v
	}
	c.w.WriteHeader(c.statusCode())
	_, _ = c.w.Write(c.body.Bytes())
	if c.flushed {
		_ = http.NewResponseController(c.w).Flush()
	}
}
