package saferetry_test

import (
	"bufio"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/retry"
)

// An unkeyed POST that reached the server is never sent again, whatever
// text the server puts in its answer: an HTTP/1 status line that reads
// "REFUSED_STREAM" (echoed in net/http's parse error) must not pass for a
// refused HTTP/2 stream, a request that provably never left.
func TestServerTextCannotPassForARefusedStream(t *testing.T) {
	for _, status := range []string{"REFUSED_STREAM", "stream error: stream ID 1; REFUSED_STREAM"} {
		t.Run(status, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			var got atomic.Int32
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					req, err := http.ReadRequest(bufio.NewReader(c))
					if err == nil {
						req.Body.Close()
						got.Add(1)
						c.Write([]byte("HTTP/1.1 " + status + "\r\nContent-Length: 0\r\n\r\n"))
					}
					c.Close()
				}
			}()
			t.Cleanup(func() { ln.Close(); wg.Wait() })

			base := &http.Transport{}
			defer base.CloseIdleConnections()
			tr := saferetry.NewTransport(base, saferetry.WithAutoKeys(false), saferetry.WithBudget(budget.Unlimited()),
				saferetry.WithLogger(slog.New(slog.DiscardHandler)))
			req, err := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+"/charge", strings.NewReader("amount=1"))
			require.NoError(t, err)
			_, err = tr.RoundTrip(req)
			require.ErrorIs(t, err, retry.ErrExhausted)
			require.Equal(t, int32(1), got.Load(), "the unkeyed POST was sent again after it reached the server")
		})
	}
}
