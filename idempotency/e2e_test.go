package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// pipeNet connects an http.Transport to an http.Server through net.Pipe
// connections, so that both real halves run inside a testing/synctest bubble
// (fake time: the client's Retry-After sleep takes no real time).
type pipeNet struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

func newPipeNet() *pipeNet {
	return &pipeNet{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (p *pipeNet) Accept() (net.Conn, error) {
	select {
	case c := <-p.conns:
		return c, nil
	case <-p.done:
		return nil, net.ErrClosed
	}
}

func (p *pipeNet) Close() error {
	p.once.Do(func() { close(p.done) })
	return nil
}

func (p *pipeNet) Addr() net.Addr { return pipeAddr{} }

func (p *pipeNet) Dial(ctx context.Context, _, _ string) (net.Conn, error) {
	srv, cli := net.Pipe()
	select {
	case p.conns <- srv:
		return cli, nil
	case <-p.done:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// attempt is what the server saw of one request.
type attempt struct {
	key      string
	status   int
	replayed bool
	code     string
}

type recorder struct {
	http.ResponseWriter
	status int
}

func (r *recorder) WriteHeader(code int) { r.status = code; r.ResponseWriter.WriteHeader(code) }

// Both halves end to end. The real saferetry Transport sends
// through real net/http to a server with deadline.Middleware and the
// idempotency middleware.
func TestEndToEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var (
			mu        sync.Mutex
			attempts  []attempt
			effects   atomic.Int64
			gate      = make(chan struct{})
			deadlines = make(chan time.Time, 10)
		)
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := effects.Add(1)
			if d, ok := r.Context().Deadline(); ok {
				deadlines <- d
			}
			if n == 1 {
				<-gate
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"payment":%d}`, n)
		})
		mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
		mux := http.NewServeMux()
		mux.Handle("POST /payments", deadline.Middleware(mw.Wrap(handler)))
		logged := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			rec := &recorder{ResponseWriter: w, status: http.StatusOK}
			mux.ServeHTTP(rec, r)
			code := ""
			if rec.status == http.StatusConflict || rec.status == http.StatusUnprocessableEntity {
				code = "problem"
			}
			mu.Lock()
			attempts = append(attempts, attempt{r.Header.Get("Idempotency-Key"), rec.status,
				w.Header().Get(idempotency.ReplayedHeader) == "true", code})
			mu.Unlock()
		})

		pn := newPipeNet()
		srv := &http.Server{Handler: logged}
		served := make(chan error, 1)
		go func() { served <- srv.Serve(pn) }()
		base := &http.Transport{DialContext: pn.Dial}
		client := &http.Client{Transport: saferetry.NewTransport(base,
			saferetry.WithBudget(budget.Unlimited()),
			saferetry.WithLogger(quiet))}
		defer func() {
			base.CloseIdleConnections()
			require.NoError(t, srv.Close())
			require.ErrorIs(t, <-served, http.ErrServerClosed)
		}()

		type result struct {
			status   int
			replayed string
			body     string
			err      error
		}
		postKey := func(ctx context.Context, key, body string) result {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://payments.test/payments", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", key)
			req.Header.Set("Authorization", "Bearer test-client")
			resp, err := client.Do(req)
			if err != nil {
				return result{err: err}
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return result{resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader), string(b), nil}
		}

		// Client 1 starts the payment; its handler stalls.
		ctx1, cancel1 := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel1()
		clientDeadline, _ := ctx1.Deadline()
		first := make(chan result)
		go func() { first <- postKey(ctx1, "pay-e2e", `{"amount":100}`) }()
		synctest.Wait()
		select {
		case d := <-deadlines:
			require.WithinDuration(t, clientDeadline, d, 50*time.Millisecond,
				"the handler's deadline must match the client's remaining time")
		default:
			close(gate)
			<-first
			t.Fatal("the handler's context has no deadline")
		}

		// Client 2 (a retry of the same logical request from elsewhere)
		// meets the in-progress conflict and backs off for Retry-After.
		second := make(chan result)
		go func() { second <- postKey(t.Context(), "pay-e2e", `{"amount":100}`) }()
		synctest.Wait()
		mu.Lock()
		require.Equal(t, []attempt{{"pay-e2e", http.StatusConflict, false, "problem"}}, attempts)
		mu.Unlock()

		// The first finishes; the second's retry gets the replay.
		close(gate)
		r1 := <-first
		require.NoError(t, r1.err)
		require.Equal(t, http.StatusCreated, r1.status)
		require.Empty(t, r1.replayed)
		r2 := <-second
		require.NoError(t, r2.err)
		require.Equal(t, http.StatusCreated, r2.status)
		require.Equal(t, "true", r2.replayed)
		require.Equal(t, r1.body, r2.body)
		require.EqualValues(t, 1, effects.Load())
		mu.Lock()
		require.Equal(t, []attempt{
			{"pay-e2e", http.StatusConflict, false, "problem"}, // client 2, attempt 1
			{"pay-e2e", http.StatusCreated, false, ""},         // client 1
			{"pay-e2e", http.StatusCreated, true, ""},          // client 2, attempt 2
		}, attempts)
		mu.Unlock()

		// The same key with another body: 422, not retried.
		mu.Lock()
		before := len(attempts)
		mu.Unlock()
		r3 := postKey(t.Context(), "pay-e2e", `{"amount":999}`)
		require.NoError(t, r3.err)
		require.Equal(t, http.StatusUnprocessableEntity, r3.status)
		require.Contains(t, r3.body, idempotency.CodeKeyReused)
		mu.Lock()
		require.Len(t, attempts, before+1, "a 422 must not be retried")
		mu.Unlock()
		require.EqualValues(t, 1, effects.Load())
	})
}
