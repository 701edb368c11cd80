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
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// The raw HTTP/1.1 answers whose body stalls after a few bytes: the
// Transport reads such a body itself to drain a discarded 503 and to peek
// at a 409's problem code.
const (
	stalled503 = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 1000\r\n\r\nover"
	stalled409 = "HTTP/1.1 409 Conflict\r\nContent-Type: application/problem+json\r\n" +
		"Content-Length: 1000\r\n\r\n{\"code\":"
)

// serveStalled answers every request on conns accepted from l with the raw
// answer, then reads from the connection until the client closes it or
// stall passes (0: never), and closes it. It counts the requests in hits
// and returns when l is closed and every connection is done.
func serveStalled(l net.Listener, answer string, stall time.Duration, hits *atomic.Int32) {
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
			hits.Add(1)
			if _, err := io.WriteString(conn, answer); err != nil {
				return
			}
			io.Copy(io.Discard, conn) // until the client closes, or the stall ends
		}()
	}
}

// quietTransport builds a Transport with the given options, an unlimited
// budget, a fixed wait of 100 ms before each retry and a discarding logger.
func quietTransport(base http.RoundTripper, opts ...Option) *Transport {
	fixed := func(int, time.Duration, time.Duration, time.Duration, float64) time.Duration {
		return 100 * time.Millisecond
	}
	return NewTransport(base, append([]Option{WithBudget(budget.Unlimited()),
		WithBackoff(jitter.Config{Func: fixed}), WithLogger(slog.New(slog.DiscardHandler))}, opts...)...)
}

// stallBounds are the ways a call can be bounded, each with what a stalled
// in-progress 409 then gives: its attempts (each bounded by the 1 s of the
// peek or the attempt's own limit, whichever ends first), the loop's reason
// to stop, and how long the call takes in all (with the 100 ms waits).
var stallBounds = []struct {
	name    string
	opts    []Option
	ctx     time.Duration // the caller's context deadline; 0 for none
	hits409 int32
	stop409 retry.Reason
	took409 time.Duration
}{
	{"defaults", nil, 0, 3, retry.ReasonMaxAttempts, 3200 * time.Millisecond},
	{"max elapsed 500ms", []Option{WithMaxElapsed(500 * time.Millisecond)}, 0,
		1, retry.ReasonDeadline, 500 * time.Millisecond},
	{"attempt timeout 200ms only", []Option{WithMaxElapsed(0), WithAttemptTimeout(200 * time.Millisecond)}, 0,
		3, retry.ReasonMaxAttempts, 800 * time.Millisecond},
	{"context deadline 500ms only", []Option{WithMaxElapsed(0)}, 500 * time.Millisecond,
		1, "", 500 * time.Millisecond},
	{"no bound at all", []Option{WithMaxElapsed(0)}, 0, 3, retry.ReasonMaxAttempts, 3200 * time.Millisecond},
}

// stalledCall sends a GET through a Transport with opts to a server that
// answers with the stalled answer, inside a synctest bubble, and returns
// what it gave, how long it took and how many requests the server saw.
func stalledCall(t *testing.T, answer string, opts []Option, ctxDeadline time.Duration,
	check func(resp *http.Response, err error, took time.Duration, hits int32)) {
	synctest.Test(t, func(t *testing.T) {
		l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
		var hits atomic.Int32
		served := make(chan struct{})
		go func() { defer close(served); serveStalled(l, answer, 0, &hits) }()
		base := &http.Transport{DialContext: l.dial}
		defer func() { base.CloseIdleConnections(); l.Close(); <-served }()

		ctx := context.Background()
		if ctxDeadline > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, ctxDeadline)
			defer cancel()
		}
		start := time.Now()
		req := get(t, "http://pipe.test/").WithContext(ctx)
		resp, err := quietTransport(base, opts...).RoundTrip(req)
		took := time.Since(start)
		check(resp, err, took, hits.Load())
		if resp != nil {
			resp.Body.Close() // handed over: the caller's to read or not
		}
	})
}

// A discarded 503 whose body stalls is drained only within the wait before
// the retry, then dropped: every attempt is sent and the last 503 is
// returned, whatever bounds the call (or none), in the time of the waits
// alone.
func TestStalled503BodyIsDrainedWithinTheWait(t *testing.T) {
	for _, b := range stallBounds {
		t.Run(b.name, func(t *testing.T) {
			stalledCall(t, stalled503, b.opts, b.ctx, func(resp *http.Response, err error, took time.Duration,
				hits int32) {
				require.NoError(t, err)
				assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
				assert.Equal(t, int32(3), hits, "every attempt was sent")
				assert.Equal(t, 200*time.Millisecond, took, "the two waits, nothing more")
			})
		})
	}
}

// The peek at a stalled in-progress 409 is bounded by the attempt's limit
// and by its own second: the attempt times out (retried as any timeout),
// and the call never outlives its bounds, nor hangs without any.
func TestStalled409PeekIsBounded(t *testing.T) {
	for _, b := range stallBounds {
		t.Run(b.name, func(t *testing.T) {
			stalledCall(t, stalled409, b.opts, b.ctx, func(resp *http.Response, err error, took time.Duration,
				hits int32) {
				assert.Equal(t, b.hits409, hits)
				assert.Equal(t, b.took409, took)
				if b.stop409 == "" {
					// The caller's deadline ended the peek: the 409 is
					// handed over, and its body reads as the caller's error.
					require.NoError(t, err)
					assert.Equal(t, http.StatusConflict, resp.StatusCode)
					_, err := io.ReadAll(resp.Body)
					assert.ErrorIs(t, err, context.DeadlineExceeded)
					return
				}
				require.Nil(t, resp)
				assert.ErrorIs(t, err, ErrAttemptTimeout)
				var ee *retry.ExhaustedError
				require.ErrorAs(t, err, &ee)
				assert.Equal(t, b.stop409, ee.Reason)
				assert.Equal(t, int(b.hits409), ee.Attempts, "attempts counted are attempts sent")
			})
		})
	}
}

// The same over loopback TCP, on the real clock: a server that stalls for
// 5 s holds a call with a 300 ms overall deadline no longer than that
// deadline and a wide margin for a loaded machine, and the call gives what
// it gives in a bubble.
func TestStalledBodiesOverLoopback(t *testing.T) {
	for name, answer := range map[string]string{"503": stalled503, "409 in progress": stalled409} {
		t.Run(name, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			var hits atomic.Int32
			served := make(chan struct{})
			go func() { defer close(served); serveStalled(l, answer, 5*time.Second, &hits) }()
			base := &http.Transport{}
			defer func() { base.CloseIdleConnections(); l.Close(); <-served }()

			tr := quietTransport(base, WithMaxElapsed(300*time.Millisecond),
				WithBackoff(jitter.Config{Func: halfJitter, Base: time.Millisecond, Cap: time.Millisecond}))
			// A hung test ends.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			start := time.Now()
			resp, err := tr.RoundTrip(get(t, "http://"+l.Addr().String()+"/").WithContext(ctx))
			took := time.Since(start)
			if answer == stalled503 {
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
				assert.Equal(t, int32(3), hits.Load())
			} else {
				assert.True(t, errors.Is(err, ErrAttemptTimeout), "%v", err)
				assert.Equal(t, int32(1), hits.Load(), "the 300 ms deadline ends the peek of attempt 1")
			}
			assert.Less(t, took, 2*time.Second, "300 ms deadline, far less than the 5 s stall")
		})
	}
}

// When the overall deadline passes between the decision to retry and the
// retry (here an observer that takes 600 ms of a 500 ms deadline), the
// retry is neither sent nor counted.
func TestNoAttemptStartsWithNoTimeLeft(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503}}
		base, url := pipeServer(t, srv)
		var done CallDoneInfo
		slow := Observer{
			AttemptDone: func(context.Context, AttemptDoneInfo) { time.Sleep(600 * time.Millisecond) },
			CallDone:    func(_ context.Context, info CallDoneInfo) { done = info },
		}
		tr := quietTransport(base, WithMaxElapsed(500*time.Millisecond), WithObserver(slow))
		resp, err := tr.RoundTrip(get(t, url))
		require.Nil(t, resp)
		var ee *retry.ExhaustedError
		require.ErrorAs(t, err, &ee)
		assert.Equal(t, 1, ee.Attempts)
		assert.Equal(t, retry.ReasonDeadline, ee.Reason)
		assert.NotErrorIs(t, err, ErrAttemptTimeout, "no attempt timed out: none was sent")
		assert.Len(t, srv.Hits(), 1)
		assert.Equal(t, 1, done.Attempts)
		assert.Equal(t, retry.ReasonDeadline, done.Stop)
	})
}
