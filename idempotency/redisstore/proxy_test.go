package redisstore_test

import (
	"bytes"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// faultProxy is a TCP proxy in front of Redis that injects real network
// faults on the connections it carries:
//
//   - dropReplies: after a connection sent a script (EVALSHA or EVAL), the
//     first bytes Redis answers are not forwarded; the connection is closed
//     instead. Redis ran the script; its caller never hears it. It hits the
//     next n scripts, one per connection.
//   - latency: every chunk Redis answers is held this long first.
//   - hold: new connections are accepted but carry nothing until release,
//     so that a call go-redis sends again on a fresh connection waits.
type faultProxy struct {
	ln      net.Listener
	target  string
	drops   atomic.Int64  // scripts whose reply is still to drop
	dropped atomic.Int64  // replies dropped so far
	latency atomic.Int64  // nanoseconds
	drop    chan struct{} // a send per reply dropped
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   map[net.Conn]bool
	gate    chan struct{} // nil, or closed by release
	closed  chan struct{} // closed by close: a held answer is dropped
}

func newFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &faultProxy{ln: ln, target: target, conns: map[net.Conn]bool{},
		drop: make(chan struct{}, 16), closed: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *faultProxy) addr() string { return p.ln.Addr().String() }

// dropReplies makes the next n scripts' replies be lost with their
// connections.
func (p *faultProxy) dropReplies(n int) { p.drops.Store(int64(n)) }

func (p *faultProxy) setLatency(d time.Duration) { p.latency.Store(int64(d)) }

// hold makes new connections wait, carrying nothing, until release.
func (p *faultProxy) hold() {
	p.mu.Lock()
	p.gate = make(chan struct{})
	p.mu.Unlock()
}

func (p *faultProxy) release() {
	p.mu.Lock()
	if p.gate != nil {
		close(p.gate)
		p.gate = nil
	}
	p.mu.Unlock()
}

// dropped1 waits until a reply is dropped.
func (p *faultProxy) dropped1(t *testing.T) {
	t.Helper()
	select {
	case <-p.drop:
	case <-time.After(10 * time.Second):
		t.Fatal("no reply was dropped")
	}
}

func (p *faultProxy) track(c net.Conn, on bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		return false
	}
	if on {
		p.conns[c] = true
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *faultProxy) close() {
	close(p.closed)
	_ = p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
	if p.gate != nil {
		close(p.gate)
		p.gate = nil
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *faultProxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		gate := p.gate
		p.mu.Unlock()
		if gate != nil {
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				<-gate
				p.connect(client)
			}()
			continue
		}
		p.connect(client)
	}
}

// connect links client to a new connection to Redis.
func (p *faultProxy) connect(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	if !p.track(client, true) || !p.track(server, true) {
		_ = client.Close()
		_ = server.Close()
		return
	}
	p.wg.Add(2)
	var armed atomic.Bool // this connection sent a script whose reply is to drop
	closeBoth := func() {
		_ = client.Close()
		_ = server.Close()
		p.track(client, false)
		p.track(server, false)
	}
	go func() { // client to Redis
		defer p.wg.Done()
		defer closeBoth()
		buf := make([]byte, 64<<10)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				chunk := bytes.ToUpper(buf[:n])
				script := bytes.Contains(chunk, []byte("EVAL"))
				if script && p.drops.Load() > 0 && p.drops.Add(-1) >= 0 {
					armed.Store(true)
				}
				if _, werr := server.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	go func() { // Redis to client
		defer p.wg.Done()
		defer closeBoth()
		buf := make([]byte, 64<<10)
		for {
			n, err := server.Read(buf)
			if n > 0 {
				if armed.Load() {
					p.dropped.Add(1)
					select {
					case p.drop <- struct{}{}:
					default:
					}
					return // the reply is lost with the connection
				}
				if d := time.Duration(p.latency.Load()); d > 0 {
					select {
					case <-time.After(d):
					case <-p.closed:
						return
					}
				}
				if _, werr := client.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
}
