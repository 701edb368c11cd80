package saferetry

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
)

// stalledAnswers are the raw HTTP/1.1 answers whose body stalls after a few
// bytes: the Transport reads such a body itself to drain a discarded 503
// and to peek at a 409's problem code.
var stalledAnswers = map[string]string{
	"503": "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 1000\r\n\r\nover",
	"409 in progress": "HTTP/1.1 409 Conflict\r\nContent-Type: application/problem+json\r\n" +
		"Content-Length: 1000\r\n\r\n{\"code\":",
}

// serveStalled answers every request on conns accepted from l with the raw
// answer, then reads from the connection until the client closes it or
// stall passes (0: never), and closes it. It returns when l is closed and
// every connection is done.
func serveStalled(l net.Listener, answer string, stall time.Duration) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer conn.Close()
			if stall > 0 {
				conn.SetDeadline(time.Now().Add(stall))
			}
			if _, err := http.ReadRequest(bufio.NewReader(conn)); err != nil {
				return
			}
			if _, err := io.WriteString(conn, answer); err != nil {
				return
			}
			io.Copy(io.Discard, conn) // until the client closes, or the stall ends
		}()
	}
}

// quietTransport builds a Transport with the given options, an unlimited
// budget and a discarding logger.
func quietTransport(base http.RoundTripper, opts ...Option) *Transport {
	return NewTransport(base, append([]Option{WithBudget(budget.Unlimited()),
		WithLogger(slog.New(slog.DiscardHandler))}, opts...)...)
}

// A server that sends the headers of a 503 or of an in-progress 409 and
// then stalls the body holds the Transport's own reads (the drain, the
// peek) no longer than the overall deadline: every read the Transport does
// on its own behalf is under the attempt's time limit.
func TestStalledBodiesDoNotOutliveTheDeadline(t *testing.T) {
	for name, answer := range stalledAnswers {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
				served := make(chan struct{})
				go func() { defer close(served); serveStalled(l, answer, 0) }()
				base := &http.Transport{DialContext: l.dial}
				defer func() { base.CloseIdleConnections(); l.Close(); <-served }()

				tr := quietTransport(base, WithMaxElapsed(500*time.Millisecond))
				start := time.Now()
				resp, err := tr.RoundTrip(get(t, "http://pipe.test/"))
				took := time.Since(start)
				if err == nil {
					resp.Body.Close() // the last 503, handed over: the caller's to read or not
				} else {
					assert.ErrorIs(t, err, ErrAttemptTimeout)
				}
				assert.LessOrEqual(t, took, 500*time.Millisecond, "the overall deadline bounds the call")
			})
		})
	}
}

// The same over loopback TCP, on the real clock: a server that stalls for
// 5 s holds a call with a 300 ms overall deadline no longer than that
// deadline and a wide margin for a loaded machine.
func TestStalledBodiesOverLoopback(t *testing.T) {
	for name, answer := range stalledAnswers {
		t.Run(name, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			served := make(chan struct{})
			go func() { defer close(served); serveStalled(l, answer, 5*time.Second) }()
			base := &http.Transport{}
			defer func() { base.CloseIdleConnections(); l.Close(); <-served }()

			tr := quietTransport(base, WithMaxElapsed(300*time.Millisecond))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // a hung test ends
			defer cancel()
			start := time.Now()
			resp, err := tr.RoundTrip(get(t, "http://"+l.Addr().String()+"/").WithContext(ctx))
			took := time.Since(start)
			if err == nil {
				resp.Body.Close()
			} else {
				assert.True(t, errors.Is(err, ErrAttemptTimeout), "%v", err)
			}
			assert.Less(t, took, 2*time.Second, "300 ms deadline, far less than the 5 s stall")
		})
	}
}
