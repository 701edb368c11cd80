package saferetry_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/retry"
)

// wireRequest is one request as a server read it off the wire.
type wireRequest struct {
	attempt, key string
	body         int // bytes of body
}

// closingServer is a raw TCP server that answers the first request on each
// connection with 200, then reads the second and closes the connection
// without answering: what a client meets on a kept-alive connection that
// the server (or a proxy) closes while the request is on its way.
type closingServer struct {
	addr string
	mu   sync.Mutex
	seen []wireRequest
}

func newClosingServer(t *testing.T) *closingServer {
	s := &closingServer{}
	s.addr = serveRaw(t, s.serve)
	return s
}

// serveRaw serves each connection a TCP listener on the loopback accepts
// with serve, on a goroutine of its own, and returns the listener's
// address. The test's cleanup closes the listener and every connection,
// and waits for serve to return.
func serveRaw(t *testing.T, serve func(net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				serve(c)
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func (s *closingServer) serve(c net.Conn) {
	br := bufio.NewReader(c)
	for n := 1; n <= 2; n++ {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		body, _ := io.Copy(io.Discard, req.Body)
		s.mu.Lock()
		s.seen = append(s.seen, wireRequest{attempt: req.Header.Get("Request-Attempt"),
			key: req.Header.Get("Idempotency-Key"), body: int(body)})
		s.mu.Unlock()
		if n == 1 {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	}
}

// take returns the requests read so far and forgets them.
func (s *closingServer) take() []wireRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := s.seen
	s.seen = nil
	return seen
}

// counted is what the Transport says it sent: its log records of
// attempts, its observers' attempts, and their numbers.
type counted struct {
	mu       sync.Mutex
	logged   int
	observed []int
}

func (c *counted) Enabled(context.Context, slog.Level) bool { return true }
func (c *counted) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *counted) WithGroup(string) slog.Handler            { return c }
func (c *counted) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "attempt" {
			c.mu.Lock()
			c.logged++
			c.mu.Unlock()
		}
		return true
	})
	return nil
}

func (c *counted) observer() saferetry.Observer {
	return saferetry.Observer{AttemptStart: func(ctx context.Context, i saferetry.AttemptStartInfo) context.Context {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.observed = append(c.observed, i.Attempt)
		return ctx
	}}
}

// resendCase is one request of TestEveryRequestOnTheWireIsACountedAttempt.
type resendCase struct {
	name, method string
	body         string
	key          bool // an automatic key
}

var resendCases = []resendCase{
	{name: "GET", method: http.MethodGet},
	{name: "POST with a key and a body", method: http.MethodPost, body: "amount=1", key: true},
	{name: "POST with a body, no key", method: http.MethodPost, body: "amount=1"},
	{name: "bodyless POST with a key", method: http.MethodPost, key: true},
	{name: "bodyless POST, no key", method: http.MethodPost},
}

// Every request on the wire is an attempt the Transport decides, numbers,
// logs and observes. The call's first attempt rides a kept-alive
// connection that the server closes after reading it, without an answer:
// net/http's Transport would send it again by itself, once, on a new
// connection (Request.isReplayable). The Transport stops that re-send and
// its loop retries instead, as attempt 2, when the request may be repeated
// (never a POST without a key). A bodyless GET is the exception: net/http
// re-sends it, and only a request body would stop it (see the package
// documentation), so the wire holds one request more than the Transport
// counts, both numbered 1.
func TestEveryRequestOnTheWireIsACountedAttempt(t *testing.T) {
	for _, tc := range resendCases {
		t.Run(tc.name, func(t *testing.T) {
			srv := newClosingServer(t)
			url := "http://" + srv.addr + "/orders"
			base := &http.Transport{}
			defer base.CloseIdleConnections()
			var n counted
			tr := saferetry.NewTransport(base, saferetry.WithLogger(slog.New(&n)),
				saferetry.WithObserver(n.observer()), saferetry.WithAutoKeys(tc.key),
				saferetry.WithBudget(budget.Unlimited()))

			// The warm-up opens the connection the call then rides.
			warm, err := base.RoundTrip(newRequest(t, http.MethodGet, url, ""))
			require.NoError(t, err)
			io.Copy(io.Discard, warm.Body)
			warm.Body.Close()
			srv.take()

			resp, err := tr.RoundTrip(newRequest(t, tc.method, url, tc.body))
			if err == nil {
				resp.Body.Close()
			}
			wire := srv.take()
			t.Logf("%s: %d on the wire (Request-Attempt %v), %d logged, %d observed %v; err %v",
				tc.name, len(wire), attempts(wire), n.logged, len(n.observed), n.observed, err)

			for _, w := range wire {
				assert.Equal(t, len(tc.body), w.body, "each request carries the whole body")
				if tc.key {
					assert.Equal(t, wire[0].key, w.key, "every attempt carries the call's key")
					assert.NotEmpty(t, w.key)
				}
			}
			switch {
			case tc.method == http.MethodGet:
				require.NoError(t, err)
				assert.Equal(t, []string{"1", "1"}, attempts(wire), "net/http re-sends a bodyless GET")
				assert.Equal(t, 1, n.logged)
				assert.Equal(t, []int{1}, n.observed)
			case tc.key:
				require.NoError(t, err, "a request with a key is retried")
				assert.Equal(t, []string{"1", "2"}, attempts(wire))
				assert.Equal(t, 2, n.logged)
				assert.Equal(t, []int{1, 2}, n.observed)
			default:
				require.ErrorIs(t, err, retry.ErrExhausted, "a POST is never sent again without a key")
				assert.Equal(t, []string{"1"}, attempts(wire))
				assert.Equal(t, 1, n.logged)
				assert.Equal(t, []int{1}, n.observed)
			}
		})
	}
}

func newRequest(t *testing.T, method, url, body string) *http.Request {
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, url, r)
	require.NoError(t, err)
	return req
}

func attempts(wire []wireRequest) []string {
	out := make([]string, len(wire))
	for i, w := range wire {
		out[i] = w.attempt
	}
	return out
}

// A request whose body net/http would rewind to send it again by itself
// does not reach the wire twice through a base transport that rewinds
// through GetBody: the caller's GetBody is never called by the base, and
// the caller's request is left as it was.
func TestTheCallersRequestIsLeftAsItWas(t *testing.T) {
	srv := newClosingServer(t)
	url := "http://" + srv.addr + "/orders"
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	tr := saferetry.NewTransport(base, saferetry.WithLogger(nil), saferetry.WithBudget(budget.Unlimited()))
	warm, err := base.RoundTrip(newRequest(t, http.MethodGet, url, ""))
	require.NoError(t, err)
	io.Copy(io.Discard, warm.Body)
	warm.Body.Close()

	req := newRequest(t, http.MethodPost, url, "amount=1")
	req.Header.Set("Idempotency-Key", "order-17")
	calls := 0
	getBody := req.GetBody
	req.GetBody = func() (io.ReadCloser, error) { calls++; return getBody() }
	header := req.Header.Clone()
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, header, req.Header, "the caller's header is the caller's")
	assert.Equal(t, 1, calls, "GetBody is called once, by the loop, for attempt 2")
	assert.Len(t, srv.take(), 3, "the warm-up, attempt 1 and attempt 2")
}

// h2Server is a raw HTTP/2 server without TLS (prior knowledge) that
// refuses the first stream of each connection with RST_STREAM
// REFUSED_STREAM, and answers every other with 200: a stream the server
// never processed, which net/http's HTTP/2 transport sends again by itself
// when it can. It counts the requests (HEADERS frames) on the wire.
type h2Server struct {
	addr    string
	mu      sync.Mutex
	headers int
}

func newH2Server(t *testing.T) *h2Server {
	s := &h2Server{}
	s.addr = serveRaw(t, s.serve)
	return s
}

// frame writes one HTTP/2 frame.
func frame(w io.Writer, typ, flags byte, stream uint32, payload []byte) error {
	h := make([]byte, 9, 9+len(payload))
	h[0], h[1], h[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	h[3], h[4] = typ, flags
	binary.BigEndian.PutUint32(h[5:], stream)
	_, err := w.Write(append(h, payload...))
	return err
}

func (s *h2Server) serve(c net.Conn) {
	br := bufio.NewReader(c)
	preface := make([]byte, len("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	if _, err := io.ReadFull(br, preface); err != nil {
		return
	}
	const (
		data, headers, rstStream, settings = 0x0, 0x1, 0x3, 0x4
		endStream, ack, endHeaders         = 0x1, 0x1, 0x4
		refusedStream                      = 0x7
		status200                          = 0x88 // HPACK: the static table's ":status: 200"
	)
	if frame(c, settings, 0, 0, nil) != nil {
		return
	}
	streams, refused := 0, uint32(0)
	for {
		var h [9]byte
		if _, err := io.ReadFull(br, h[:]); err != nil {
			return
		}
		payload := make([]byte, int(h[0])<<16|int(h[1])<<8|int(h[2]))
		if _, err := io.ReadFull(br, payload); err != nil {
			return
		}
		typ, flags, id := h[3], h[4], binary.BigEndian.Uint32(h[5:])&0x7fffffff
		var err error
		switch {
		case typ == settings && flags&ack == 0:
			err = frame(c, settings, ack, 0, nil)
		case typ == headers:
			streams++
			s.mu.Lock()
			s.headers++
			s.mu.Unlock()
			if streams == 1 {
				refused = id
				err = frame(c, rstStream, 0, id, binary.BigEndian.AppendUint32(nil, refusedStream))
				break
			}
			if flags&endStream != 0 {
				err = frame(c, headers, endHeaders|endStream, id, []byte{status200})
			}
		case typ == data && flags&endStream != 0 && id != refused:
			err = frame(c, headers, endHeaders|endStream, id, []byte{status200})
		}
		if err != nil {
			return
		}
	}
}

// Over HTTP/2, net/http does not send a request again when its connection
// closes before the answer; it does for a stream the server refused
// (REFUSED_STREAM) or, after a GOAWAY, did not process. A request with a
// body is then an attempt of the loop like any other (its GetBody
// refuses); a bodyless one is re-sent by net/http's HTTP/2 transport, which
// the Transport cannot stop without sending a body: the server had not
// processed the refused stream.
func TestARefusedHTTP2StreamIsACountedAttemptWhenItHasABody(t *testing.T) {
	for _, tc := range []resendCase{
		{name: "GET", method: http.MethodGet},
		{name: "POST with a key and a body", method: http.MethodPost, body: "amount=1", key: true},
		{name: "POST with a body, no key", method: http.MethodPost, body: "amount=1"},
		{name: "bodyless POST with a key", method: http.MethodPost, key: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newH2Server(t)
			protocols := new(http.Protocols)
			protocols.SetUnencryptedHTTP2(true)
			base := &http.Transport{Protocols: protocols}
			defer base.CloseIdleConnections()
			var n counted
			tr := saferetry.NewTransport(base, saferetry.WithLogger(slog.New(&n)),
				saferetry.WithObserver(n.observer()), saferetry.WithAutoKeys(tc.key),
				saferetry.WithBudget(budget.Unlimited()))
			resp, err := tr.RoundTrip(newRequest(t, tc.method, "http://"+srv.addr+"/", tc.body))
			require.NoError(t, err, "a refused stream was never processed: it is sent again")
			resp.Body.Close()
			srv.mu.Lock()
			wire := srv.headers
			srv.mu.Unlock()
			t.Logf("%s over HTTP/2: %d on the wire, %d logged, %d observed", tc.name, wire, n.logged,
				len(n.observed))
			assert.Equal(t, 2, wire)
			if tc.body == "" {
				assert.Equal(t, []int{1}, n.observed, "net/http's HTTP/2 transport re-sends a bodyless request")
				return
			}
			assert.Equal(t, []int{1, 2}, n.observed)
			assert.Equal(t, 2, n.logged)
		})
	}
}

// Over HTTP/2, a connection that closes before the answer is not followed
// by a re-send of net/http's: the loop retries, as attempt 2.
func TestHTTP2DoesNotResendAfterALostConnection(t *testing.T) {
	var (
		mu    sync.Mutex
		seen  []string
		conns = map[net.Conn]int{}
	)
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	type connKey struct{}
	srv := &http.Server{Protocols: protocols,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			c := r.Context().Value(connKey{}).(net.Conn)
			mu.Lock()
			seen = append(seen, r.Header.Get("Request-Attempt"))
			conns[c]++
			second := conns[c] == 2
			mu.Unlock()
			if second {
				c.Close() // read, never answered
				return
			}
			fmt.Fprint(w, "ok")
		})}
	go srv.Serve(ln)
	defer srv.Close()
	base := &http.Transport{Protocols: protocols}
	defer base.CloseIdleConnections()
	var n counted
	tr := saferetry.NewTransport(base, saferetry.WithLogger(slog.New(&n)),
		saferetry.WithObserver(n.observer()), saferetry.WithBudget(budget.Unlimited()))
	url := "http://" + ln.Addr().String() + "/"
	for method, body := range map[string]string{http.MethodGet: "", http.MethodPost: "amount=1"} {
		mu.Lock()
		seen, conns, n.observed = nil, map[net.Conn]int{}, nil
		mu.Unlock()
		warm, err := tr.RoundTrip(newRequest(t, method, url, ""))
		require.NoError(t, err)
		warm.Body.Close()
		resp, err := tr.RoundTrip(newRequest(t, method, url, body))
		require.NoError(t, err)
		resp.Body.Close()
		mu.Lock()
		t.Logf("%s over HTTP/2: Request-Attempt on the wire %v, observed %v", method, seen, n.observed)
		assert.Equal(t, []string{"1", "1", "2"}, seen, "the warm-up, then attempts 1 and 2")
		assert.Equal(t, []int{1, 1, 2}, n.observed)
		mu.Unlock()
	}
}
