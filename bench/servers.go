package bench

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
)

// Body is the 64-byte response body of every successful answer.
var Body = []byte(strings.Repeat("saferetry", 8)[:64])

// NewBaseTransport returns the base transport every contender sends its
// attempts through: http.DefaultTransport's settings, with enough idle
// connections per host (64) that a concurrency of 32 never has to close
// one. Each benchmark builds its own, so that one contender's connections
// (or CloseIdleConnections calls) never affect another's.
func NewBaseTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = 256
	t.MaxIdleConnsPerHost = 64
	return t
}

// Server is a loopback httptest server that counts what reaches it.
type Server struct {
	*httptest.Server
	hits     atomic.Int64 // requests that reached the handler
	newConns atomic.Int64 // TCP connections accepted
}

// Hits reports the requests that reached the handler.
func (s *Server) Hits() int64 { return s.hits.Load() }

// NewConns reports the TCP connections the server accepted.
func (s *Server) NewConns() int64 { return s.newConns.Load() }

// NewServer starts a loopback server whose handler is h, counting requests
// and new connections. The handler is called after the request is counted.
func NewServer(h http.HandlerFunc) *Server {
	s := &Server{}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		h(w, r)
	}))
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.newConns.Add(1)
		}
	}
	s.Start()
	return s
}

// OK answers 200 with Body after reading the request body to its end.
func OK(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("Content-Length", "64")
	_, _ = w.Write(Body)
}

// Unavailable answers 503 with a short body, no Retry-After.
func Unavailable(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	http.Error(w, "unavailable", http.StatusServiceUnavailable)
}

// MemTransport is a base RoundTripper without any network: it consumes and
// closes the request body, as a real transport does, and answers a canned
// 200 with Body and a fresh body reader and header each time. It exposes a
// layer's own cost. Safe for concurrent use.
type MemTransport struct{}

var textPlain = []string{"text/plain"}

// RoundTrip implements http.RoundTripper.
func (MemTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	return &http.Response{
		Status:        "200 OK",
		StatusCode:    http.StatusOK,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": textPlain},
		Body:          io.NopCloser(bytes.NewReader(Body)),
		ContentLength: int64(len(Body)),
		Request:       req,
	}, nil
}

// Probe records, for one logical request, how its body travelled: Origin is
// what was read from the caller's body readers (every pass), Sent what the
// base transport consumed, Direct the part of Sent that was pulled from a
// caller's reader during the base transport's own read. Sent-Direct bytes
// were therefore copied into a buffer of the layer before being sent.
type Probe struct {
	Origin, Sent, Direct atomic.Int64
}

type probeKey struct{}

// WithProbe returns ctx carrying p for ProbeTransport and CountingBody.
func WithProbe(ctx context.Context, p *Probe) context.Context {
	return context.WithValue(ctx, probeKey{}, p)
}

// CountingBody returns a body over payload whose reads count into p.Origin.
// Every GetBody of a benchmark request returns a fresh one over the same
// slice, so that no copy is made by the caller.
func CountingBody(payload []byte, p *Probe) io.ReadCloser {
	return &countingBody{r: bytes.NewReader(payload), p: p}
}

type countingBody struct {
	r *bytes.Reader
	p *Probe
}

func (c *countingBody) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.p.Origin.Add(int64(n))
	return n, err
}

func (c *countingBody) Close() error { return nil }

// ProbeTransport wraps base: it attributes every byte the base transport
// reads from a request body to Probe.Sent, and to Probe.Direct when it came
// straight from a caller's reader during that read. Requests without a
// Probe in their context pass through untouched.
type ProbeTransport struct{ Base http.RoundTripper }

// RoundTrip implements http.RoundTripper.
func (t ProbeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	p, _ := req.Context().Value(probeKey{}).(*Probe)
	if p == nil || req.Body == nil || req.Body == http.NoBody {
		return t.Base.RoundTrip(req)
	}
	r := *req
	r.Body = &probedBody{rc: req.Body, p: p}
	return t.Base.RoundTrip(&r)
}

type probedBody struct {
	rc io.ReadCloser
	p  *Probe
}

func (b *probedBody) Read(buf []byte) (int, error) {
	before := b.p.Origin.Load()
	n, err := b.rc.Read(buf)
	direct := min(b.p.Origin.Load()-before, int64(n))
	b.p.Sent.Add(int64(n))
	b.p.Direct.Add(max(direct, 0))
	return n, err
}

func (b *probedBody) Close() error { return b.rc.Close() }

// Drain reads a response body to its end and closes it.
func Drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// Outcome tells whether a logical request succeeded: no error and a 2xx.
func Outcome(resp *http.Response, err error) bool {
	if err != nil {
		return false
	}
	ok := resp.StatusCode >= 200 && resp.StatusCode < 300
	Drain(resp)
	return ok
}
