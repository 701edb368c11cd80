package saferetry

import (
	"context"
	"net"
	"net/http"
	"sync"
	"testing"
)

// pipeListener is a net.Listener over in-memory connections (net.Pipe).
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

// dial is the client's DialContext: one end of a new pipe, the other
// end accepted by the server.
func (l *pipeListener) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.done:
	case <-ctx.Done():
	}
	client.Close()
	server.Close()
	return nil, &net.OpError{Op: "dial", Net: "pipe", Err: net.ErrClosed}
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe.test:80" }

// pipeServer serves h with a real http.Server, and returns a real
// http.Transport that reaches it, and its URL. Their connections are
// in-memory pipes, whose I/O blocks durably: unlike loopback, the pair works
// inside a testing/synctest bubble, where time then advances only while the
// code under test sleeps or waits on a timer. Call it inside the bubble;
// t.Cleanup shuts both down.
func pipeServer(t *testing.T, h http.Handler) (*http.Transport, string) {
	l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
	srv := &http.Server{Handler: h}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(l)
	}()
	tr := &http.Transport{DialContext: l.dial}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		srv.Close()
		<-served
	})
	return tr, "http://pipe.test"
}
