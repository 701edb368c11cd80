package saferetry

import (
	"context"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/retry"
)

// restartable is a real http.Server on in-memory pipes that can be stopped
// and started again: while it is down, dialling it is refused, as a
// restarting process's port refuses connections.
type restartable struct {
	h      http.Handler
	mu     sync.Mutex
	l      *pipeListener // nil while down
	srv    *http.Server
	served chan struct{}
}

func (r *restartable) start() {
	l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
	srv := &http.Server{Handler: r.h}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(l)
	}()
	r.mu.Lock()
	r.l, r.srv, r.served = l, srv, served
	r.mu.Unlock()
}

func (r *restartable) stop() {
	r.mu.Lock()
	srv, served := r.srv, r.served
	r.l, r.srv = nil, nil
	r.mu.Unlock()
	if srv != nil {
		srv.Close()
		<-served
	}
}

func (r *restartable) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	r.mu.Lock()
	l := r.l
	r.mu.Unlock()
	if l == nil {
		refused := os.NewSyscallError("connect", syscall.ECONNREFUSED)
		return nil, &net.OpError{Op: "dial", Net: "pipe", Err: refused}
	}
	return l.dial(ctx, network, addr)
}

// restartOutcome is what the restart scenario saw.
type restartOutcome struct {
	charges     map[retry.Reason]int // how the charges sent during the restart ended
	retried     int                  // charges whose retry the budget granted
	fullAfter   time.Duration        // from the restart's start until the bucket is full again
	retriedLate int                  // requests after the restart that were retried and succeeded
	deniedLate  int                  // requests after the restart whose retry the budget refused
	firstRetry  time.Duration        // from the restart's end to the first retried request
	lateTotal   int
	available   int // the bucket's tokens when the run ends
}

// runRestart runs the user's scenario with the budget b: 100 charges (POST,
// each with its automatic key) sent at once as the server goes down for a
// 1.5 s restart, then one request a second for 90 s, the first attempt of
// each failing with a transient 503 (a server warming up: no first attempt
// succeeds, the worst case for a bucket that only successes refill) and its
// retry succeeding.
func runRestart(t *testing.T, b budget.Budget) restartOutcome {
	const (
		charges  = 100
		downtime = 1500 * time.Millisecond
		late     = 90
	)
	out := restartOutcome{charges: map[retry.Reason]int{}, lateTotal: late}
	var (
		mu   sync.Mutex
		seen = map[string]bool{} // keys whose first attempt the server answered
	)
	srv := &restartable{h: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		again := seen[key]
		seen[key] = true
		mu.Unlock()
		if !again {
			http.Error(w, "warming up", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})}
	base := &http.Transport{DialContext: srv.dial}
	t.Cleanup(func() {
		base.CloseIdleConnections()
		srv.stop()
	})
	var stops []CallDoneInfo
	tr := newBubbleTransport(base, WithBudget(b), WithObserver(Observer{
		CallDone: func(_ context.Context, info CallDoneInfo) {
			mu.Lock()
			stops = append(stops, info)
			mu.Unlock()
		},
	}))
	charge := func() {
		body := strings.NewReader(`{"amount":1999}`)
		req, err := http.NewRequest(http.MethodPost, "http://pipe.test/charges", body)
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
	}

	// The restart: down at 0, up again after 1.5 s. The charges all meet it.
	start := time.Now()
	var wg sync.WaitGroup
	for range charges {
		wg.Go(charge)
	}
	wg.Wait()
	mu.Lock()
	for _, s := range stops {
		out.charges[s.Stop]++
		if s.Attempts > 1 {
			out.retried++
		}
	}
	stops = nil
	mu.Unlock()
	time.Sleep(downtime - time.Since(start))
	srv.start()
	up := time.Now()

	// Afterwards, one request a second.
	for range late {
		time.Sleep(time.Second)
		sent := time.Now()
		charge()
		mu.Lock()
		s := stops[len(stops)-1]
		mu.Unlock()
		switch {
		case s.Attempts == 2 && s.Response != nil && s.Response.StatusCode == http.StatusCreated:
			if out.retriedLate == 0 {
				out.firstRetry = sent.Sub(up)
			}
			out.retriedLate++
		case s.Stop == retry.ReasonBudget:
			out.deniedLate++
		}
		if out.fullAfter == 0 && b.Available(time.Now()) == 500 {
			out.fullAfter = time.Since(start)
		}
	}
	out.available = b.Available(time.Now())
	return out
}

// The user's scenario: a server restart of 1.5 s under 100 concurrent
// charges drains the default bucket (every charge meets the restart; the
// budget refuses the retries of most), and afterwards, at one request a
// second, every transient failure is retried again: time refills the
// bucket, 500 tokens a minute, so that a retry (14 tokens) is affordable
// within 1.7 s of the drain, and the bucket is full again within a minute
// (budget.TokenBucketConfig.RefillTime). The AWS SDKs' bucket (RefillTime
// negative), which only successes refill, retries none of them.
func TestRestartUnderLoadThenTheBudgetRecovers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		out := runRestart(t, budget.NewTokenBucket(budget.TokenBucketConfig{}))
		t.Logf("default bucket: the 100 charges ended %v, %d of them retried once; afterwards %d of %d "+
			"requests retried, the first %v after the restart; the bucket full again %v after the restart "+
			"began", out.charges, out.retried, out.retriedLate, out.lateTotal, out.firstRetry, out.fullAfter)
		assert.Equal(t, 100, total(out.charges), "every charge met the restart")
		assert.Equal(t, 100, out.charges[retry.ReasonBudget], "the restart drained the bucket")
		assert.Equal(t, out.lateTotal, out.retriedLate, "every failure after the restart is retried")
		assert.Zero(t, out.deniedLate)
		assert.LessOrEqual(t, out.firstRetry, time.Second, "the first request after the restart")
		assert.Equal(t, 35, out.retried, "500 tokens, 14 a retry")
		assert.Positive(t, out.fullAfter)
		assert.LessOrEqual(t, out.fullAfter, time.Minute+time.Second, "full again within RefillTime of the drain")
		assert.Equal(t, 500, out.available)
	})
	synctest.Test(t, func(t *testing.T) {
		out := runRestart(t, budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1}))
		t.Logf("bucket without refill: the 100 charges ended %v, %d of them retried once; afterwards %d "+
			"of %d requests retried, %d refused; %d tokens at the end", out.charges, out.retried,
			out.retriedLate, out.lateTotal, out.deniedLate, out.available)
		assert.Equal(t, 100, out.charges[retry.ReasonBudget])
		assert.Zero(t, out.retriedLate, "only successes refill it, and no first attempt succeeds")
		assert.Equal(t, out.lateTotal, out.deniedLate)
		assert.Equal(t, 10, out.available, "still drained after 90 s")
	})
}

func total(m map[retry.Reason]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}
