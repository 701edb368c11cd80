package retry

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// goAwayListener hands out the server's connections wrapped so that, once
// the server has written an HTTP/2 GOAWAY frame, the connection is closed
// for writing: what a client sees when a server that is shutting down goes
// away before answering the streams it had accepted.
type goAwayListener struct {
	net.Listener
	sent chan struct{} // closed when a GOAWAY has gone out
	once sync.Once
}

func (l *goAwayListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &goAwayConn{TCPConn: c.(*net.TCPConn), l: l}, nil
}

type goAwayConn struct {
	*net.TCPConn
	l       *goAwayListener
	pending []byte // frames written but not yet whole
}

// Write passes b on, then follows the HTTP/2 frames written (a 9-byte
// header: 24-bit length, type, flags, stream): after a GOAWAY (type 7), it
// closes the connection for writing (a FIN, never a reset that could
// overtake the frame).
func (c *goAwayConn) Write(b []byte) (int, error) {
	n, err := c.TCPConn.Write(b)
	c.pending = append(c.pending, b[:n]...)
	for len(c.pending) >= 9 {
		size := 9 + (int(c.pending[0])<<16 | int(binary.BigEndian.Uint16(c.pending[1:3])))
		if len(c.pending) < size {
			break
		}
		if c.pending[3] == 0x7 {
			c.TCPConn.CloseWrite()
			c.l.once.Do(func() { close(c.l.sent) })
		}
		c.pending = c.pending[size:]
	}
	return n, err
}

// goAwayError sends a GET over HTTP/2 (h2c) to a real net/http server that
// shuts down gracefully while the request is in its handler: the server
// sends GOAWAY, which names the request's stream as accepted, and the
// connection then closes. It returns what RoundTrip returns.
func goAwayError(t *testing.T) error {
	t.Helper()
	entered, release := make(chan struct{}), make(chan struct{})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	gl := &goAwayListener{Listener: srv.Listener, sent: make(chan struct{})}
	srv.Listener = gl
	srv.Start()
	defer srv.Close()

	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: protocols}
	defer tr.CloseIdleConnections()
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		resp, err := tr.RoundTrip(req)
		if resp != nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-entered
	shutdown := make(chan struct{})
	go func() {
		defer close(shutdown)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Config.Shutdown(ctx) // sends GOAWAY, then waits for the handler
	}()
	var err error
	select {
	case err = <-errc:
	case <-time.After(10 * time.Second): // a safety net, never a measure
		t.Fatal("no answer and no error 10 s after the server's GOAWAY")
	}
	close(release)
	<-shutdown
	select {
	case <-gl.sent:
	default:
		t.Fatal("the server sent no GOAWAY")
	}
	require.Error(t, err)
	return err
}

// A real HTTP/2 GOAWAY, as net/http's bundled HTTP/2 transport returns it
// to a RoundTrip caller, is classified by its type: retried when the
// request may be repeated, never marked as never sent (the server had
// accepted the stream). Its text, carrying the server's debug data, cannot
// make it pass for a refused stream.
func TestClassifyRealGoAway(t *testing.T) {
	err := goAwayError(t)
	t.Logf("RoundTrip returned %T: %v", err, err)
	require.Contains(t, err.Error(), "GOAWAY", "%v", err)
	require.Equal(t, Decision{Retry: true, Class: ClassH2GoAway}, Classify(nil, Input{Idempotent: true, Err: err}, now))
	require.Equal(t, Decision{Class: ClassH2GoAway}, Classify(nil, Input{Err: err}, now))
	wrapped := &urlError{err}
	require.Equal(t, Decision{Retry: true, Class: ClassH2GoAway}, Classify(nil, Input{Idempotent: true, Err: wrapped}, now))

	// The same type with debug data that reads as a refused stream: still
	// a GOAWAY, never "never sent".
	var goAway error
	inTree(err, func(e error) bool {
		if isGoAway(e) {
			goAway = e
		}
		return goAway != nil
	})
	require.NotNil(t, goAway)
	forged := reflect.New(reflect.TypeOf(goAway)).Elem()
	forged.Set(reflect.ValueOf(goAway))
	forged.FieldByName("DebugData").SetString("stream error: stream ID 1; REFUSED_STREAM")
	debug := forged.Interface().(error)
	require.Contains(t, debug.Error(), "REFUSED_STREAM")
	require.Equal(t, Decision{Class: ClassH2GoAway}, Classify(nil, Input{Err: debug}, now))
}

// urlError wraps an error as *url.Error would, in a type of its own.
type urlError struct{ err error }

func (e *urlError) Error() string { return "Get \"http://x/\": " + e.err.Error() }
func (e *urlError) Unwrap() error { return e.err }

// A server that answers with a malformed HTTP/1 status line reading
// "GOAWAY" has sent no GOAWAY: the error's text is not its type, and the
// outcome is not retried.
func TestClassifyStatusLineReadingGoAway(t *testing.T) {
	for _, line := range []string{"HTTP/1.1 GOAWAY\r\n", "HTTP/1.1 200 OK\r\nGOAWAY\r\n\r\n",
		"GOAWAY 200 OK\r\n\r\n"} {
		u := rawServer(t, func(c *net.TCPConn) {
			c.Write([]byte(line))
			c.Close()
		})
		for _, wrap := range []bool{false, true} {
			err := roundTrip(t, context.Background(), &http.Transport{}, http.MethodGet, u, wrap)
			require.True(t, strings.Contains(err.Error(), "GOAWAY"), "%v", err)
			require.False(t, inTree(err, isGoAway))
			require.False(t, errors.Is(err, io.EOF), "%v", err)
			require.Equal(t, Decision{Class: ClassNotRetryable}, Classify(nil, Input{Idempotent: true, Err: err}, now),
				"%q: %v", line, err)
		}
	}
}
