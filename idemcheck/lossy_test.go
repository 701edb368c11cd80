package idemcheck_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
)

// lossyProxy is an HTTP/1.1 proxy in front of target that loses the answer
// to the second request of its first maxLost client connections that carry
// one: it forwards the request, reads the target's answer (the target has
// acted), and closes the client's connection instead of passing the answer
// on. A client that rode a kept-alive connection meets what a lossy
// network gives it.
type lossyProxy struct {
	ln     net.Listener
	target string
	resend bool // send the request again upstream, and pass that answer on
	wg     sync.WaitGroup
	mu     sync.Mutex
	lost   int
}

const maxLost = 3

func newLossyProxy(t *testing.T, target string, resend bool) *lossyProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &lossyProxy{ln: ln, target: target, resend: resend}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.serve(c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); p.wg.Wait() })
	return p
}

func (p *lossyProxy) serve(c net.Conn) {
	defer c.Close()
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer up.Close()
	cr, ur := bufio.NewReader(c), bufio.NewReader(up)
	for n := 1; ; n++ {
		req, err := http.ReadRequest(cr)
		if err != nil {
			return
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		req.Body = io.NopCloser(bytes.NewReader(body))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		if req.Write(up) != nil {
			return
		}
		resp, err := http.ReadResponse(ur, req)
		if err != nil {
			return
		}
		if n == 2 {
			p.mu.Lock()
			lose := p.lost < maxLost
			if lose {
				p.lost++
			}
			p.mu.Unlock()
			if lose && !p.resend {
				resp.Body.Close()
				return // the answer is lost
			}
			if lose {
				// The answer is lost between the target and the proxy,
				// which sends the request again on a new connection.
				resp.Body.Close()
				up.Close()
				if up, err = net.Dial("tcp", p.target); err != nil {
					return
				}
				defer up.Close()
				ur = bufio.NewReader(up)
				req.Body, _ = req.GetBody()
				if req.Write(up) != nil {
					return
				}
				if resp, err = http.ReadResponse(ur, req); err != nil {
					return
				}
			}
		}
		err = resp.Write(c)
		resp.Body.Close()
		if err != nil {
			return
		}
	}
}

// Through a path that loses answers, the checker's client never sends a
// request again by itself (net/http would, for one with an Idempotency-Key
// on a kept-alive connection): the checker sends it again, with the same
// key, and knows that the answer may be a replay. Behind a proxy that sends
// a request again itself after losing the target's answer, a first answer
// can be a replay the checker cannot tell from one: the marker check
// reports it, and fails only when every first answer is one. No check
// fails on a correct server.
func TestALossyPathFailsNoCheck(t *testing.T) {
	const n = 4
	for _, resend := range []bool{false, true} {
		t.Run(map[bool]string{false: "lost answers", true: "a proxy that re-sends"}[resend], func(t *testing.T) {
			srv, _, _ := serveMiddleware(t, newStore(), n)
			proxy := newLossyProxy(t, strings.TrimPrefix(srv.URL, "http://"), resend)
			rep, err := idemcheck.Run(t.Context(), config("http://"+proxy.ln.Addr().String(), n))
			require.NoError(t, err)
			t.Log("\n" + rep.String())
			proxy.mu.Lock()
			lost := proxy.lost
			proxy.mu.Unlock()
			require.Positive(t, lost, "the proxy lost answers")
			require.False(t, rep.Failed(), rep.String())
			require.Equal(t, idemcheck.Info, results(rep)["marker"])
		})
	}
}
