package idempotency

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// capture buffers a handler's whole response, so that the record commits
// before the client sees any of it: a guarded handler cannot stream. The
// stored response's body is this buffer (a store keeps the bytes it is
// given, see Store), and bytes once written to it are never changed. A
// Flush is deferred until the response is released, 1xx responses are
// dropped, and Hijack fails with an error wrapping http.ErrNotSupported
// (bytes written to a hijacked connection could never be replayed); Unwrap
// lets http.ResponseController reach the underlying writer's deadlines.
type capture struct {
	mu          sync.Mutex // guards w, which detach replaces
	w           http.ResponseWriter
	header      http.Header
	status      int
	wroteHeader bool
	body        bytes.Buffer
	flushed     bool
}

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(code int) {
	if c.wroteHeader || (code >= 100 && code < 200) {
		return
	}
	if code < 100 || code > 999 {
		code = http.StatusInternalServerError // net/http would panic
	}
	c.status, c.wroteHeader = code, true
}

func (c *capture) Write(p []byte) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	if c.body.Cap() == 0 {
		c.body.Grow(c.declared())
	}
	return c.body.Write(p)
}

// maxPresize bounds the buffer that a declared Content-Length reserves.
const maxPresize = 64 << 20

// declared returns the Content-Length the handler set, when it is a number
// from 1 to maxPresize, else 0: the buffer then holds the body in one
// allocation, and the store keeps that very buffer (the body's one copy).
// A body of unknown length grows as written.
func (c *capture) declared() int {
	v := c.header.Get("Content-Length")
	if v == "" {
		return 0
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 || n > maxPresize {
		return 0
	}
	return int(n)
}

// Flush records the request to flush; the flush happens after the commit.
func (c *capture) Flush() { c.flushed = true }

// Hijack refuses.
func (c *capture) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, fmt.Errorf(
		"idempotency: the connection of a guarded request cannot be hijacked: %w",
		http.ErrNotSupported)
}

// Unwrap returns the underlying http.ResponseWriter; after detach, a
// writer that has no client.
func (c *capture) Unwrap() http.ResponseWriter {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.w
}

// detach cuts the capture from its client's writer, which ServeHTTP is
// about to leave (WithAcceptAfter): the handler's answer is still captured
// and stored, never sent.
func (c *capture) detach() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.w = &discardWriter{header: make(http.Header)}
}

func (c *capture) statusCode() int {
	if !c.wroteHeader {
		return http.StatusOK
	}
	return c.status
}

// release sends the buffered response to the client, without the replay
// marker, as a header or a trailer (set with http.TrailerPrefix, or
// declared in Trailer): a handler that copies another service's headers
// must not make a first execution look like a replay.
func (c *capture) release() {
	dst := c.w.Header()
	const prefix = http.TrailerPrefix
	for k, v := range c.header {
		name := k
		if len(k) > len(prefix) && strings.EqualFold(k[:len(prefix)], prefix) {
			name = k[len(prefix):]
		}
		switch {
		case strings.EqualFold(name, ReplayedHeader):
			continue
		case strings.EqualFold(k, "Trailer"):
			if v = withoutMarker(v); len(v) == 0 {
				continue
			}
		}
		dst[k] = v
	}
	c.w.WriteHeader(c.statusCode())
	_, _ = c.w.Write(c.body.Bytes())
	if c.flushed {
		_ = http.NewResponseController(c.w).Flush()
	}
}

// withoutMarker returns the Trailer field values vals without the replay
// marker's name.
func withoutMarker(vals []string) []string {
	var out []string
	for _, v := range vals {
		var names []string
		for n := range strings.SplitSeq(v, ",") {
			if n = strings.TrimSpace(n); n != "" && !strings.EqualFold(n, ReplayedHeader) {
				names = append(names, n)
			}
		}
		if len(names) > 0 {
			out = append(out, strings.Join(names, ", "))
		}
	}
	return out
}
