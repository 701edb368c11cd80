package saferetry

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/keygen"
)

// serveEcho answers every request accepted from l with a status line that
// echoes the request's key header as the server received it (one field
// line), which the client cannot parse. It returns when l is closed and
// every connection is done.
func serveEcho(l net.Listener) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		wg.Go(func() {
			defer conn.Close()
			br := bufio.NewReader(conn)
			for {
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				io.Copy(io.Discard, req.Body)
				v := req.Header.Get("Idempotency-Key")
				answer := "HTTP/1.1 " + v + " OK\r\nContent-Length: 0\r\n\r\n"
				if _, err := io.WriteString(conn, answer); err != nil {
					return
				}
			}
		})
	}
}

// keyForms are the ways a key can show up in an error's text: as it is, as
// it went on the wire (an RFC 9651 string when it needs quotes), and each
// of those quoted by %q, as net/http's errors quote what they could not
// parse.
func keyForms(key string) []string {
	forms := []string{key, keygen.FormatHeader(key)}
	for _, f := range forms[:2] {
		q := strconv.Quote(f)
		forms = append(forms, q[1:len(q)-1])
	}
	return forms
}

// A server that echoes the key where the client expects a status code puts
// the key into the transport's error, whose text reaches the log records,
// the observers and the caller: every one of them names the key by its
// digest only.
func TestTheKeyNeverReachesAnErrorText(t *testing.T) {
	for name, key := range map[string]string{
		"an automatic key":           "",
		"a key sent as an sf-string": `order"42"\a`,
		"a key that needs no quotes": "pay-0042-abcdef",
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
				served := make(chan struct{})
				go func() { defer close(served); serveEcho(l) }()
				base := &http.Transport{DialContext: l.dial}
				defer func() { base.CloseIdleConnections(); l.Close(); <-served }()

				h := &recordingHandler{}
				var texts []string
				var mu sync.Mutex
				note := func(err error) {
					if err != nil {
						mu.Lock()
						texts = append(texts, err.Error())
						mu.Unlock()
					}
				}
				var sentKey string
				tr := newBubbleTransport(base, WithLogger(slog.New(h)), WithObserver(Observer{
					AttemptStart: func(ctx context.Context, a AttemptStartInfo) context.Context {
						sentKey = a.Key
						return ctx
					},
					AttemptDone: func(_ context.Context, a AttemptDoneInfo) { note(a.Err) },
					CallDone:    func(_ context.Context, c CallDoneInfo) { note(c.Err) },
				}))
				req := post(t, context.Background(), "http://pipe.test/pay", "amount=10")
				if key != "" {
					req.Header.Set("Idempotency-Key", keygen.FormatHeader(key))
				}
				_, err := tr.RoundTrip(req)
				require.Error(t, err)
				note(err)
				for _, r := range h.records {
					if e, ok := attrs(r)["error"]; ok {
						texts = append(texts, e.String())
					}
				}
				require.NotEmpty(t, sentKey)
				if key != "" {
					require.Equal(t, key, sentKey)
				}
				require.Len(t, texts, 4, "the record, AttemptDone, CallDone and the caller's error")
				for _, text := range texts {
					assert.Contains(t, text, "malformed HTTP status code", "the error is the one the echo caused")
					assert.Contains(t, text, keygen.Digest(sentKey), "the key is named by its digest")
					for _, f := range keyForms(sentKey) {
						assert.NotContains(t, text, f)
					}
				}
			})
		})
	}
}

// The redaction keeps the transport's error matchable, through errors.As
// and errors.Is, as the retry classes need.
func TestARedactedErrorIsStillMatched(t *testing.T) {
	var key string
	base := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		key = r.Header.Get("Idempotency-Key")
		return nil, &net.OpError{Op: "read", Net: "tcp", Err: &echoError{key: key}}
	})
	tr := newTestTransport(base, WithMaxAttempts(1))
	_, err := tr.RoundTrip(post(t, context.Background(), "http://example.test/pay", "x"))
	require.Error(t, err)
	require.NotEmpty(t, key)
	assert.NotContains(t, err.Error(), key)
	assert.Contains(t, err.Error(), "echo of [key "+keygen.Digest(key)+"]")
	var echo *echoError
	require.ErrorAs(t, err, &echo)
	assert.Equal(t, key, echo.key, "the error itself is the transport's, unchanged")
	var op *net.OpError
	assert.ErrorAs(t, err, &op)
}

type echoError struct{ key string }

func (e *echoError) Error() string { return "echo of " + e.key }
