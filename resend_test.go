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
	"net/http/httptrace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/retry"
)

// wireRequest is one request as a server read it off the wire.
type wireRequest struct {
	attempt, key string
	body         int // bytes of body; -1 when the server never read it
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
		switch {
		case n == 2:
		case req.Method == http.MethodHead:
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
		default:
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

// warm opens n kept-alive connections to url through base, each with one
// request answered, and forgets those requests: the connections the call
// then rides, which the server closes after reading the next request. The
// bodies are read once every request is answered, so that each request
// takes a connection of its own.
func (s *closingServer) warm(t *testing.T, base http.RoundTripper, url string, n int) {
	var bodies []io.ReadCloser
	for range n {
		warm, err := base.RoundTrip(newRequest(t, http.MethodGet, url, ""))
		require.NoError(t, err)
		bodies = append(bodies, warm.Body)
	}
	for _, b := range bodies {
		io.Copy(io.Discard, b)
		b.Close()
	}
	require.Len(t, s.take(), n)
}

// counted is what the Transport says it sent: its log records of
// attempts, its observers' attempts and their numbers, the classes of the
// attempts it told done, the attempts of the call, and the retries it
// charged to the budget.
type counted struct {
	mu       sync.Mutex
	logged   int
	observed []int
	classes  []retry.Class
	errs     []error // the attempts' errors, as told done
	call     int     // CallDoneInfo.Attempts
	charged  int
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
	}, AttemptDone: func(_ context.Context, i saferetry.AttemptDoneInfo) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.classes = append(c.classes, i.Decision.Class)
		c.errs = append(c.errs, i.Err)
	}, CallDone: func(_ context.Context, i saferetry.CallDoneInfo) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.call = i.Attempts
	}}
}

// budget returns an unlimited budget that counts the retries charged to it.
func (c *counted) budget() budget.Budget { return chargedBudget{Budget: budget.Unlimited(), c: c} }

type chargedBudget struct {
	budget.Budget
	c *counted
}

func (b chargedBudget) AcquireRetry(now time.Time, throttled bool) (int, bool) {
	b.c.mu.Lock()
	b.c.charged++
	b.c.mu.Unlock()
	return b.Budget.AcquireRetry(now, throttled)
}

// transport returns a Transport over base that tells c everything, with
// opts after.
func (c *counted) transport(base http.RoundTripper, opts ...saferetry.Option) *saferetry.Transport {
	return saferetry.NewTransport(base, append([]saferetry.Option{saferetry.WithLogger(slog.New(c)),
		saferetry.WithObserver(c.observer()), saferetry.WithBudget(c.budget())}, opts...)...)
}

// check asserts that the requests on the wire are the attempts counted:
// numbered 1 to len(wire) (in any order: two servers' goroutines may note
// them out of order), each logged, observed, told done, counted in the
// call, and, but for attempt 1, charged to the budget as a retry; every
// attempt but the last ended in a re-send (retry.ClassResend), which the
// base transport made when resent, else the loop, the Transport having
// refused the base's.
func (c *counted) check(t *testing.T, wire []wireRequest, resent bool) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	k := len(wire)
	numbers := make([]int, k)
	for i, w := range wire {
		numbers[i], _ = strconv.Atoi(w.attempt)
	}
	slices.Sort(numbers)
	var want []int
	for i := range k {
		want = append(want, i+1)
	}
	assert.Equal(t, want, numbers, "Request-Attempt on the wire")
	assert.Equal(t, k, c.logged, "log records")
	assert.Equal(t, want, c.observed, "attempts observed")
	assert.Len(t, c.classes, k, "attempts told done")
	assert.Equal(t, k, c.call, "CallDoneInfo.Attempts")
	assert.Equal(t, k-1, c.charged, "retries charged to the budget")
	for i := 0; i+1 < len(c.classes); i++ {
		assert.Equal(t, retry.ClassResend, c.classes[i], "attempt %d", i+1)
		var re *retry.ResendError
		if assert.ErrorAs(t, c.errs[i], &re, "attempt %d", i+1) {
			assert.Equal(t, resent, re.Resent, "attempt %d: %v", i+1, re)
		}
	}
}

// resendCase is one request of the tests below.
type resendCase struct {
	name, method string
	body         string
	key          bool // an automatic key
}

var resendCases = []resendCase{
	{name: "GET", method: http.MethodGet},
	{name: "HEAD", method: http.MethodHead},
	{name: "bodyless POST with a key", method: http.MethodPost, key: true},
	{name: "POST with a key and a body", method: http.MethodPost, body: "amount=1", key: true},
	{name: "POST with a body, no key", method: http.MethodPost, body: "amount=1"},
	{name: "bodyless POST, no key", method: http.MethodPost},
}

// Every request on the wire is an attempt the Transport numbers, logs,
// observes and charges. The call's first attempt rides a kept-alive
// HTTP/1.1 connection that the server closes after reading it, without an
// answer. net/http sends a bodyless GET, HEAD or keyed POST again by
// itself, once, on a new connection (Request.isReplayable): the Transport
// counts that send as attempt 2. One with a body it never sends again (its
// GetBody refuses): the loop retries it, as attempt 2, when it may be
// repeated, and a POST without a key never is.
func TestEveryRequestOnTheWireIsACountedAttempt(t *testing.T) {
	for _, tc := range resendCases {
		t.Run(tc.name, func(t *testing.T) {
			srv := newClosingServer(t)
			url := "http://" + srv.addr + "/orders"
			base := &http.Transport{}
			defer base.CloseIdleConnections()
			var n counted
			tr := n.transport(base, saferetry.WithAutoKeys(tc.key))
			srv.warm(t, base, url, 1)

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
			if tc.method == http.MethodPost && !tc.key {
				require.ErrorIs(t, err, retry.ErrExhausted, "a POST is never sent again without a key")
				assert.Len(t, wire, 1)
			} else {
				require.NoError(t, err)
				assert.Len(t, wire, 2)
			}
			n.check(t, wire, tc.body == "")
		})
	}
}

// net/http sends a bodyless GET again for as long as the kept-alive
// connections it picks die before the answer: each send is an attempt,
// numbered in turn, even past WithMaxAttempts, which the re-sends use up
// (they cannot be refused: each is on its way when the Transport learns of
// it); and a call marked NoRetry counts net/http's re-send as attempt 2.
func TestEachResendIsAnAttemptPastTheLimit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		conns int // kept-alive connections that die
		opts  []saferetry.Option
		ctx   func(context.Context) context.Context
	}{
		{name: "two dead connections, 3 attempts", conns: 2},
		{name: "two dead connections, 2 attempts", conns: 2,
			opts: []saferetry.Option{saferetry.WithMaxAttempts(2)}},
		{name: "NoRetry", conns: 1, ctx: saferetry.NoRetry},
		{name: "a deadline header of its own on each send", conns: 2,
			opts: []saferetry.Option{saferetry.WithDeadlineHeader(true)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newClosingServer(t)
			url := "http://" + srv.addr + "/orders"
			base := &http.Transport{}
			defer base.CloseIdleConnections()
			var n counted
			tr := n.transport(base, tc.opts...)
			srv.warm(t, base, url, tc.conns)
			req := newRequest(t, http.MethodGet, url, "")
			if tc.ctx != nil {
				req = req.WithContext(tc.ctx(req.Context()))
			}
			req.Header.Set("Accept", "application/json")
			header := req.Header.Clone()
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, header, req.Header, "the caller's header is the caller's")
			wire := srv.take()
			t.Logf("%s: Request-Attempt on the wire %v, observed %v", tc.name, attempts(wire), n.observed)
			assert.Len(t, wire, tc.conns+1)
			assert.Equal(t, strconv.Itoa(tc.conns+1), resp.Request.Header.Get("Request-Attempt"),
				"the response is the last send's")
			n.check(t, wire, true)
		})
	}
}

// A re-send of an attempt of a hedged round runs on the goroutine that
// sends it, beside the loop, which may start a hedge meanwhile: each send
// is still an attempt of its own number, under -race. (A hedge that loses
// before it is written is an attempt that never reached the wire.)
func TestAResendInAHedgedRoundIsAnAttempt(t *testing.T) {
	for range 5 {
		srv := newClosingServer(t)
		url := "http://" + srv.addr + "/orders"
		base := &http.Transport{}
		var n counted
		tr := n.transport(base, saferetry.WithHedging(saferetry.Hedging{Delay: time.Microsecond}))
		srv.warm(t, base, url, 2)
		resp, err := tr.RoundTrip(newRequest(t, http.MethodGet, url, ""))
		require.NoError(t, err)
		resp.Body.Close()
		base.CloseIdleConnections()
		wire := srv.take()
		t.Logf("hedged: Request-Attempt on the wire %v, observed %v", attempts(wire), n.observed)
		n.mu.Lock()
		numbers := map[int]bool{}
		for _, w := range wire {
			k, _ := strconv.Atoi(w.attempt)
			assert.False(t, numbers[k], "Request-Attempt %d twice on the wire", k)
			assert.Contains(t, n.observed, k, "a send that is not an attempt")
			numbers[k] = true
		}
		assert.Len(t, n.observed, len(slices.Compact(slices.Sorted(slices.Values(n.observed)))),
			"an attempt number twice")
		assert.Equal(t, len(n.observed), n.logged)
		assert.Equal(t, len(n.observed), n.call)
		assert.Equal(t, len(n.observed)-1, n.charged)
		n.mu.Unlock()
	}
}

// The trace the Transport puts on an attempt composes with the caller's:
// the caller's GotConn is told of every send, and only the sends of the
// attempt itself count, not the requests a preparation makes with its
// context.
func TestTheCallersTraceSeesEverySend(t *testing.T) {
	srv := newClosingServer(t)
	url := "http://" + srv.addr + "/orders"
	side := newClosingServer(t)
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	var n counted
	tr := n.transport(base, saferetry.WithPrepare(func(r *http.Request, _ int) error {
		// A token fetched with the attempt's context, as a signer may.
		token, err := base.RoundTrip(newRequest(t, http.MethodGet, "http://"+side.addr+"/token", "").
			WithContext(r.Context()))
		if err != nil {
			return err
		}
		return token.Body.Close()
	}))
	srv.warm(t, base, url, 1)
	var mu sync.Mutex
	gotConn := 0
	trace := &httptrace.ClientTrace{GotConn: func(httptrace.GotConnInfo) { mu.Lock(); gotConn++; mu.Unlock() }}
	req := newRequest(t, http.MethodGet, url, "")
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	wire := srv.take()
	assert.Len(t, side.take(), 1, "the preparation's request")
	mu.Lock()
	assert.Equal(t, 3, gotConn, "the preparation's request and the two sends")
	mu.Unlock()
	n.check(t, wire, true)
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

// h2Front is a loopback HTTP/2 server without TLS (prior knowledge) that
// does not process a stream, as a loaded server may not: a front passes
// every frame between the client and a net/http server behind it, and
// answers the first HEADERS frame of its first connection itself, once it
// has passed it on, with RST_STREAM REFUSED_STREAM (the client may send it
// again on the same connection or a new one) or with GOAWAY whose last
// stream ID is 0 (goaway: on a new connection). The server notes every
// request it reads, what was on the wire, and leaves the one the front
// answered unanswered until its connection closes.
type h2Front struct {
	addr, backend string
	goaway        bool
	arrived       chan wireRequest // what the server read, in the order it noted it
	mu            sync.Mutex
	conns         int // client connections accepted
	// held: the front's addresses whose first request it answered, each
	// with a channel the server closes when it has noted that request.
	held map[string]chan struct{}
}

func newH2Front(t *testing.T, goaway bool) *h2Front {
	f := &h2Front{goaway: goaway, arrived: make(chan wireRequest, 16),
		held: map[string]chan struct{}{}}
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Protocols: protocols, Handler: http.HandlerFunc(f.handle)}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	f.backend = ln.Addr().String()
	f.addr = serveRaw(t, f.serve)
	return f
}

func (f *h2Front) handle(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	noted, hold := f.held[r.RemoteAddr]
	delete(f.held, r.RemoteAddr)
	f.mu.Unlock()
	seen := wireRequest{attempt: r.Header.Get("Request-Attempt"), key: r.Header.Get("Idempotency-Key"),
		body: -1}
	if hold {
		f.arrived <- seen
		close(noted)
		<-r.Context().Done()
		return
	}
	n, _ := io.Copy(io.Discard, r.Body)
	seen.body = int(n)
	f.arrived <- seen
	io.WriteString(w, "ok")
}

// HTTP/2 frame types, flags and error codes the front uses.
const (
	h2Headers, h2RSTStream, h2GoAway = 0x1, 0x3, 0x7
	h2RefusedStream                  = 0x7
)

// readFrame reads one HTTP/2 frame: its 9-byte header and its payload.
func readFrame(r io.Reader) ([]byte, error) {
	f := make([]byte, 9)
	if _, err := io.ReadFull(r, f); err != nil {
		return nil, err
	}
	f = append(f, make([]byte, int(f[0])<<16|int(f[1])<<8|int(f[2]))...)
	_, err := io.ReadFull(r, f[9:])
	return f, err
}

// frame returns one HTTP/2 frame.
func frame(typ, flags byte, stream uint32, payload []byte) []byte {
	h := make([]byte, 9, 9+len(payload))
	h[0], h[1], h[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	h[3], h[4] = typ, flags
	binary.BigEndian.PutUint32(h[5:], stream)
	return append(h, payload...)
}

// serve passes the frames of client connection c to a connection of its
// own to the server and back, each frame whole, and answers the first
// HEADERS frame as the front does.
func (f *h2Front) serve(c net.Conn) {
	s, err := net.Dial("tcp", f.backend)
	if err != nil {
		return
	}
	defer s.Close()
	f.mu.Lock()
	f.conns++
	refuse := f.conns == 1 // a send again on a new connection goes through
	noted := make(chan struct{})
	if refuse {
		f.held[s.LocalAddr().String()] = noted
	}
	f.mu.Unlock()
	var (
		wmu     sync.Mutex            // the writes to c
		settled = make(chan struct{}) // the server's first frame, its SETTINGS, is passed on
		wg      sync.WaitGroup
	)
	defer wg.Wait()
	defer s.Close()
	wg.Go(func() {
		br := bufio.NewReader(s)
		for first := true; ; first = false {
			fr, err := readFrame(br)
			if err != nil {
				c.Close()
				return
			}
			wmu.Lock()
			_, err = c.Write(fr)
			wmu.Unlock()
			if first {
				close(settled)
			}
			if err != nil {
				return
			}
		}
	})
	br := bufio.NewReader(c)
	preface := make([]byte, len("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	if _, err := io.ReadFull(br, preface); err != nil {
		return
	}
	if _, err := s.Write(preface); err != nil {
		return
	}
	for {
		fr, err := readFrame(br)
		if err != nil {
			return
		}
		if _, err := s.Write(fr); err != nil {
			return
		}
		if fr[3] != h2Headers || !refuse {
			continue
		}
		refuse = false
		id := binary.BigEndian.Uint32(fr[5:]) & 0x7fffffff
		answer := frame(h2RSTStream, 0, id, binary.BigEndian.AppendUint32(nil, h2RefusedStream))
		if f.goaway {
			answer = frame(h2GoAway, 0, 0, make([]byte, 8)) // last stream 0, NO_ERROR
		}
		<-settled // a frame before the server's SETTINGS is a connection error
		wmu.Lock()
		_, err = c.Write(answer)
		wmu.Unlock()
		if err != nil {
			return
		}
		// Nothing more goes to the server until it has noted the request
		// answered: so it holds that one, not the one sent again, and has
		// read it before a client that moves on closes this connection.
		select {
		case <-noted:
		case <-time.After(10 * time.Second): // a bound on a failure, which take reports
		}
	}
}

// take returns the n requests the server noted, waiting for the last ones
// (at most 10 s, a bound on a failure, not a sleep), and fails the test
// when there are more or fewer.
func (f *h2Front) take(t *testing.T, n int) []wireRequest {
	var seen []wireRequest
	for range n {
		select {
		case w := <-f.arrived:
			seen = append(seen, w)
		case <-time.After(10 * time.Second):
			t.Errorf("%d requests on the wire, want %d", len(seen), n)
			return seen
		}
	}
	select {
	case w := <-f.arrived:
		t.Errorf("a request more on the wire: %+v", w)
	default:
	}
	return seen
}

// Over HTTP/2, net/http sends a bodyless request again by itself when the
// server refused its stream (REFUSED_STREAM) or, by a GOAWAY, did not
// process it: the Transport counts that send as attempt 2, whatever the
// method (the server did not process the first). One with a body it never
// sends again (its GetBody refuses): the loop retries it, as attempt 2,
// since the server did not process it, with a key or without.
func TestAnUnprocessedHTTP2StreamIsACountedAttempt(t *testing.T) {
	for _, goaway := range []bool{false, true} {
		for _, tc := range resendCases {
			name := "REFUSED_STREAM/" + tc.name
			if goaway {
				name = "GOAWAY/" + tc.name
			}
			t.Run(name, func(t *testing.T) {
				srv := newH2Front(t, goaway)
				protocols := new(http.Protocols)
				protocols.SetUnencryptedHTTP2(true)
				base := &http.Transport{Protocols: protocols}
				defer base.CloseIdleConnections()
				var n counted
				tr := n.transport(base, saferetry.WithAutoKeys(tc.key))
				resp, err := tr.RoundTrip(newRequest(t, tc.method, "http://"+srv.addr+"/", tc.body))
				require.NoError(t, err, "the server did not process the first: it is sent again")
				resp.Body.Close()
				wire := srv.take(t, 2)
				t.Logf("%s over HTTP/2: Request-Attempt on the wire %v, %d logged, observed %v", name,
					attempts(wire), n.logged, n.observed)
				for _, w := range wire {
					if w.body >= 0 {
						assert.Equal(t, len(tc.body), w.body, "the request answered carries the whole body")
					}
					if tc.key {
						assert.Equal(t, wire[0].key, w.key, "every attempt carries the call's key")
						assert.NotEmpty(t, w.key)
					}
				}
				n.check(t, wire, tc.body == "")
			})
		}
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
