package saferetry

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/retry"
)

// plan is a test server that answers each attempt (by its Request-Attempt
// number) after a delay, with a status, unless the request's context ends
// first. It records what it saw.
type plan struct {
	answers map[int]planned // by attempt number; a missing one answers 200 at once
	mu      sync.Mutex
	seen    []seen
}

type planned struct {
	after  time.Duration
	status int
	header http.Header
	body   string // "" for "attempt <n>: <status>"
}

type seen struct {
	attempt  int
	at       time.Time
	key      string
	canceled bool // the request's context ended before the answer
}

func (p *plan) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	n, _ := strconv.Atoi(r.Header.Get(attemptHeader))
	a, ok := p.answers[n]
	if !ok {
		a = planned{status: http.StatusOK}
	}
	s := seen{attempt: n, at: time.Now(), key: r.Header.Get("Idempotency-Key")}
	if a.after > 0 {
		select {
		case <-time.After(a.after):
		case <-r.Context().Done():
			s.canceled = true
		}
	}
	p.mu.Lock()
	p.seen = append(p.seen, s)
	p.mu.Unlock()
	if s.canceled {
		return
	}
	for k, v := range a.header {
		w.Header()[k] = v
	}
	w.WriteHeader(a.status)
	if a.body != "" {
		io.WriteString(w, a.body)
		return
	}
	fmt.Fprintf(w, "attempt %d: %d", n, a.status)
}

// Seen returns what the server saw, by attempt number.
func (p *plan) Seen() map[int]seen {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := map[int]seen{}
	for _, s := range p.seen {
		m[s.attempt] = s
	}
	return m
}

// hedgeEvents records what the observers see of each attempt.
type hedgeEvents struct {
	mu    sync.Mutex
	start map[int]AttemptStartInfo
	done  map[int]AttemptDoneInfo
	calls []CallDoneInfo
}

func (e *hedgeEvents) observer() Observer {
	e.start, e.done = map[int]AttemptStartInfo{}, map[int]AttemptDoneInfo{}
	return Observer{
		AttemptStart: func(ctx context.Context, a AttemptStartInfo) context.Context {
			e.mu.Lock()
			defer e.mu.Unlock()
			e.start[a.Attempt] = a
			return ctx
		},
		AttemptDone: func(_ context.Context, a AttemptDoneInfo) {
			e.mu.Lock()
			defer e.mu.Unlock()
			if _, twice := e.done[a.Attempt]; twice {
				panic(fmt.Sprintf("AttemptDone twice for attempt %d", a.Attempt))
			}
			e.done[a.Attempt] = a
		},
		CallDone: func(_ context.Context, c CallDoneInfo) {
			e.mu.Lock()
			defer e.mu.Unlock()
			e.calls = append(e.calls, c)
		},
	}
}

func (e *hedgeEvents) outcomes() map[int]Outcome {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[int]Outcome{}
	for n, d := range e.done {
		m[n] = d.Outcome
	}
	return m
}

// hedgeCall sends req through a Transport with hedging h over a pipe
// server of p, inside a synctest bubble, and returns the answer's status
// and body (or the error), how long the call took and what the observers
// saw.
func hedgeCall(t *testing.T, p *plan, req func(url string) *http.Request, opts ...Option) (
	status int, body string, took time.Duration, ev *hedgeEvents, err error) {
	ev = &hedgeEvents{}
	synctest.Test(t, func(t *testing.T) {
		base, url := pipeServer(t, p)
		tr := newBubbleTransport(base, append([]Option{WithObserver(ev.observer())}, opts...)...)
		start := time.Now()
		resp, rerr := tr.RoundTrip(req(url))
		took = time.Since(start)
		err = rerr
		if rerr == nil {
			b, rerr := io.ReadAll(resp.Body)
			require.NoError(t, rerr, "the winner's body is whole: its context lives until it is closed")
			resp.Body.Close()
			status, body = resp.StatusCode, string(b)
		}
		synctest.Wait() // the losers have ended
	})
	return status, body, took, ev, err
}

// hedge10ms hedges after 10 ms, once.
var hedge10ms = WithHedging(Hedging{Delay: 10 * time.Millisecond})

func getReq(t *testing.T) func(string) *http.Request {
	return func(url string) *http.Request { return get(t, url) }
}

// A hedge goes when the attempt in flight has had no answer for the delay;
// the first final answer wins, the loser is canceled, and the hedge counts
// as an attempt: its own Request-Attempt number, its own observer events
// with the hedge flag.
func TestAHedgeGoesAfterTheDelayAndTheFirstAnswerWins(t *testing.T) {
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	status, body, took, ev, err := hedgeCall(t, p, getReq(t),
		hedge10ms)
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 2: 200", body, "the hedge answered first")
	assert.Equal(t, 10*time.Millisecond, took, "no wait for the loser")

	seen := p.Seen()
	require.Len(t, seen, 2)
	assert.Equal(t, 10*time.Millisecond, seen[2].at.Sub(seen[1].at), "the hedge went after the delay")
	assert.True(t, seen[1].canceled, "the loser was canceled")
	assert.False(t, seen[2].canceled)

	assert.False(t, ev.start[1].Hedge)
	assert.True(t, ev.start[2].Hedge)
	assert.Empty(t, ev.start[2].Retrying, "a hedge retries nothing")
	assert.Equal(t, map[int]Outcome{1: OutcomeLost, 2: OutcomeFinal}, ev.outcomes())
	assert.True(t, ev.done[2].Hedge)
	assert.Nil(t, ev.done[1].Response)
	assert.Nil(t, ev.done[1].Err)
	require.Len(t, ev.calls, 1)
	assert.Equal(t, 2, ev.calls[0].Attempts, "hedges are attempts")
	assert.Equal(t, OutcomeFinal, ev.calls[0].Outcome)
}

// Without hedging, or with it turned off, the slow attempt is the only one.
func TestNoHedgeUnlessAsked(t *testing.T) {
	for name, opts := range map[string][]Option{
		"no option":      nil,
		"MaxHedges < 0":  {WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: -1})},
		"one attempt":    {hedge10ms, WithMaxAttempts(1)},
		"adaptive, cold": {WithHedging(Hedging{})},
	} {
		t.Run(name, func(t *testing.T) {
			p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
			status, _, took, _, err := hedgeCall(t, p, getReq(t), opts...)
			require.NoError(t, err)
			assert.Equal(t, 200, status)
			assert.Equal(t, time.Second, took)
			assert.Len(t, p.Seen(), 1)
		})
	}
	// NoRetry turns hedges off too.
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	_, _, _, _, err := hedgeCall(t, p, func(url string) *http.Request {
		return get(t, url).WithContext(NoRetry(context.Background()))
	}, hedge10ms)
	require.NoError(t, err)
	assert.Len(t, p.Seen(), 1)
}

// A retryable answer while another attempt is in flight is set aside, and
// the loop waits for the other: the caller gets the slow success, not the
// hedge's 503.
func TestARetryableAnswerWhileAnotherIsInFlightIsDiscarded(t *testing.T) {
	p := &plan{answers: map[int]planned{
		1: {after: time.Second, status: 200},
		2: {status: 503},
	}}
	status, body, took, ev, err := hedgeCall(t, p, getReq(t),
		hedge10ms, WithMaxAttempts(2))
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 1: 200", body)
	assert.Equal(t, time.Second, took)
	assert.Equal(t, map[int]Outcome{1: OutcomeFinal, 2: OutcomeDiscarded}, ev.outcomes())
	assert.Equal(t, 503, ev.done[2].Response.StatusCode)
}

// When every attempt of a hedged round fails, the caller gets an answer if
// any attempt had one (the http.RoundTripper contract), never an error in
// its place: the 503 of the hedge, not the error of the first attempt that
// ended after it.
func TestAnAnswerIsKeptOverALaterError(t *testing.T) {
	p := &plan{answers: map[int]planned{
		1: {after: 200 * time.Millisecond, status: 200},
		2: {status: 503},
	}}
	status, body, took, ev, err := hedgeCall(t, p, getReq(t), hedge10ms,
		WithMaxAttempts(2), WithAttemptTimeout(100*time.Millisecond))
	require.NoError(t, err)
	assert.Equal(t, 503, status)
	assert.Equal(t, "attempt 2: 503", body)
	assert.Equal(t, 100*time.Millisecond, took, "attempt 1 timed out")
	assert.Equal(t, map[int]Outcome{1: OutcomeDiscarded, 2: OutcomeStopped}, ev.outcomes())
	assert.ErrorIs(t, ev.done[1].Err, ErrAttemptTimeout)
	assert.Equal(t, retry.ReasonMaxAttempts, ev.calls[0].Stop)
}

// When both answers of a round are retryable, the round ends with the
// later one and the loop retries as usual: once an attempt of the round
// failed, no more hedges go (a hedge answers slowness, not failure); the
// retry waits its backoff and is no hedge.
func TestARoundOfFailuresIsRetried(t *testing.T) {
	p := &plan{answers: map[int]planned{
		1: {after: 100 * time.Millisecond, status: 503},
		2: {status: 502},
	}}
	status, body, _, ev, err := hedgeCall(t, p, getReq(t), hedge10ms)
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 3: 200", body)
	assert.Equal(t, map[int]Outcome{1: OutcomeRetry, 2: OutcomeDiscarded, 3: OutcomeFinal},
		ev.outcomes())
	assert.False(t, ev.start[3].Hedge)
	assert.Equal(t, retry.Class("status_503"), ev.start[3].Retrying)
	seen := p.Seen()
	// The retry waits half of the 100 ms bound of attempt 2's backoff.
	assert.Equal(t, 150*time.Millisecond, seen[3].at.Sub(seen[1].at))
}

// Hedges and retries share the attempt limit; MaxHedges bounds the hedges
// in flight at once.
func TestHedgesAndRetriesShareTheAttemptLimit(t *testing.T) {
	slow := planned{after: time.Second, status: 200}
	p := &plan{answers: map[int]planned{1: slow, 2: slow, 3: slow, 4: slow, 5: slow}}
	_, _, took, ev, err := hedgeCall(t, p, getReq(t),
		WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: 10}), WithMaxAttempts(4))
	require.NoError(t, err)
	assert.Equal(t, time.Second, took)
	seen := p.Seen()
	require.Len(t, seen, 4, "4 attempts in all")
	for n := 2; n <= 4; n++ {
		assert.Equal(t, time.Duration(n-1)*10*time.Millisecond, seen[n].at.Sub(seen[1].at), "hedge %d", n)
	}
	assert.Equal(t, map[int]Outcome{1: OutcomeFinal, 2: OutcomeLost, 3: OutcomeLost, 4: OutcomeLost},
		ev.outcomes())

	p = &plan{answers: map[int]planned{1: slow, 2: slow, 3: slow}}
	_, _, _, _, err = hedgeCall(t, p, getReq(t),
		WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: 1}), WithMaxAttempts(5))
	require.NoError(t, err)
	assert.Len(t, p.Seen(), 2, "one hedge in flight at once, and neither answers before the other")
}

// One overall deadline bounds every attempt, hedges included, and no hedge
// starts after it.
func TestOneDeadlineBoundsTheHedges(t *testing.T) {
	slow := planned{after: time.Minute, status: 200}
	p := &plan{answers: map[int]planned{1: slow, 2: slow, 3: slow}}
	_, _, took, ev, err := hedgeCall(t, p, getReq(t),
		WithHedging(Hedging{Delay: 40 * time.Millisecond, MaxHedges: 5}),
		WithMaxElapsed(100*time.Millisecond))
	var ex *retry.ExhaustedError
	require.ErrorAs(t, err, &ex)
	assert.ErrorIs(t, err, ErrAttemptTimeout)
	assert.Equal(t, 100*time.Millisecond, took)
	assert.Len(t, p.Seen(), 3, "hedges at 40 and 80 ms")
	assert.Equal(t, 3, ex.Attempts)
	// All three time out at once: the last one the loop hears is judged.
	count := map[Outcome]int{}
	for _, o := range ev.outcomes() {
		count[o]++
	}
	assert.Equal(t, map[Outcome]int{OutcomeDiscarded: 2, OutcomeStopped: 1}, count)
}

// A POST or PATCH hedges only with a key, and every hedge carries the same
// key; a request that may not be repeated is never hedged.
func TestOnlyRequestsThatMayBeRepeatedAreHedged(t *testing.T) {
	slow := map[int]planned{1: {after: time.Second, status: 201}}
	hedging := hedge10ms
	for _, tc := range []struct {
		name   string
		req    func(t *testing.T, url string) *http.Request
		opts   []Option
		hedged bool
	}{
		{"a POST with an automatic key", func(t *testing.T, url string) *http.Request {
			return post(t, context.Background(), url, "amount=10")
		}, nil, true},
		{"a PATCH with the caller's key", func(t *testing.T, url string) *http.Request {
			r, err := http.NewRequest(http.MethodPatch, url, strings.NewReader("x"))
			require.NoError(t, err)
			r.Header.Set("Idempotency-Key", "order-42")
			return r
		}, nil, true},
		{"a POST without a key", func(t *testing.T, url string) *http.Request {
			return post(t, context.Background(), url, "amount=10")
		}, []Option{WithAutoKeys(false)}, false},
		{"a POST marked idempotent without a key", func(t *testing.T, url string) *http.Request {
			return post(t, Idempotent(context.Background(), true), url, "amount=10")
		}, []Option{WithAutoKeys(false)}, false},
		{"a PUT marked not idempotent", func(t *testing.T, url string) *http.Request {
			ctx := Idempotent(context.Background(), false)
			r, err := http.NewRequestWithContext(ctx, http.MethodPut, url, strings.NewReader("x"))
			require.NoError(t, err)
			return r
		}, nil, false},
		{"a body too large to buffer", func(t *testing.T, url string) *http.Request {
			r, err := http.NewRequest(http.MethodPut, url, io.NopCloser(strings.NewReader("0123456789")))
			require.NoError(t, err)
			return r
		}, []Option{WithMaxBufferedBody(4)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &plan{answers: slow}
			_, _, _, _, err := hedgeCall(t, p, func(url string) *http.Request { return tc.req(t, url) },
				append([]Option{hedging}, tc.opts...)...)
			require.NoError(t, err)
			seen := p.Seen()
			if !tc.hedged {
				assert.Len(t, seen, 1)
				return
			}
			require.Len(t, seen, 2)
			assert.NotEmpty(t, seen[1].key)
			assert.Equal(t, seen[1].key, seen[2].key, "every hedge carries the same key")
		})
	}
}

// Each hedge spends the host's retry budget at a transient retry's cost;
// a hedge that wins with a success gets it back, as a retried success
// does, and one that loses does not. (The buckets of these tests are the
// AWS SDKs', RefillTime -1, so that time adds nothing to the count.)
func TestHedgesSpendTheRetryBudget(t *testing.T) {
	for _, tc := range []struct {
		name    string
		answers map[int]planned
		left    int
	}{
		{"the hedge wins", map[int]planned{1: {after: time.Second, status: 200}}, 500},
		{"the hedge loses", map[int]planned{1: {after: 20 * time.Millisecond, status: 200},
			2: {after: time.Second, status: 200}}, 500 - 14 + 1}, // and attempt 1's success adds 1
	} {
		t.Run(tc.name, func(t *testing.T) {
			bucket := budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
			p := &plan{answers: tc.answers}
			_, _, _, _, err := hedgeCall(t, p, getReq(t), hedge10ms,
				WithBudget(bucket))
			require.NoError(t, err)
			assert.Len(t, p.Seen(), 2)
			assert.Equal(t, tc.left, bucket.Available(time.Now()))
		})
	}
}

// When the budget refuses, no hedge starts, and the attempt in flight is
// never killed: it answers, late.
func TestABudgetDenialStopsHedgingButKillsNothing(t *testing.T) {
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 13, RefillTime: -1})
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	status, body, took, ev, err := hedgeCall(t, p, getReq(t),
		hedge10ms, WithBudget(bucket))
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 1: 200", body)
	assert.Equal(t, time.Second, took)
	assert.Len(t, p.Seen(), 1)
	assert.False(t, p.Seen()[1].canceled)
	assert.Equal(t, map[int]Outcome{1: OutcomeFinal}, ev.outcomes())
}

// No hedge follows pushback (an answer marked Retried-Below) or an answer
// with a Retry-After, for the rest of the call: the retry after it is
// slow, and goes alone.
func TestNoHedgeAfterPushbackOrRetryAfter(t *testing.T) {
	for name, first := range map[string]planned{
		"Retry-After": {status: 503, header: http.Header{"Retry-After": {"1"}}},
		"Retry-After on the in-progress 409": {status: 409, header: http.Header{"Retry-After": {"1"},
			"Content-Type": {"application/problem+json"}},
			body: `{"code":"idempotency_request_in_progress"}`},
	} {
		t.Run(name, func(t *testing.T) {
			p := &plan{answers: map[int]planned{1: first, 2: {after: time.Second, status: 200}}}
			_, _, _, ev, err := hedgeCall(t, p, func(url string) *http.Request {
				return post(t, context.Background(), url, "x")
			}, hedge10ms)
			require.NoError(t, err)
			assert.Len(t, p.Seen(), 2, "the retry goes alone")
			assert.Equal(t, OutcomeFinal, ev.outcomes()[2])
		})
	}
	// A marked answer that comes while a hedge is in flight is final: it
	// wins, and nothing is retried.
	p := &plan{answers: map[int]planned{
		1: {after: 20 * time.Millisecond, status: 503, header: http.Header{markHeader: {"true"}}},
		2: {after: time.Second, status: 200},
	}}
	status, _, _, ev, err := hedgeCall(t, p, getReq(t), hedge10ms)
	require.NoError(t, err)
	assert.Equal(t, 503, status)
	assert.Equal(t, map[int]Outcome{1: OutcomeStopped, 2: OutcomeLost}, ev.outcomes())
	assert.Equal(t, retry.ReasonRetriedBelow, ev.done[1].Stop)
}

// The log records show each hedge as an attempt, with hedge=true.
func TestLogsShowHedges(t *testing.T) {
	h := &recordingHandler{}
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	_, _, _, _, err := hedgeCall(t, p, getReq(t), hedge10ms,
		WithLogger(slog.New(h)))
	require.NoError(t, err)
	byAttempt := map[int64]slog.Record{}
	for _, r := range h.records {
		byAttempt[attrs(r)["attempt"].Int64()] = r
	}
	require.Len(t, byAttempt, 2)
	assert.Equal(t, "lost", attrs(byAttempt[1])["outcome"].String())
	assert.Equal(t, slog.LevelDebug, byAttempt[1].Level)
	_, hedged := attrs(byAttempt[1])["hedge"]
	assert.False(t, hedged)
	assert.True(t, attrs(byAttempt[2])["hedge"].Bool())
	assert.Equal(t, "final", attrs(byAttempt[2])["outcome"].String())
}

// pipeServerH2 is pipeServer speaking HTTP/2 without TLS (h2c) on both
// sides: the attempts of a call share one connection, each its own stream.
func pipeServerH2(t *testing.T, h http.Handler) (*http.Transport, string) {
	l := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: h, Protocols: &protocols}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(l)
	}()
	tr := &http.Transport{DialContext: l.dial, Protocols: &protocols}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		srv.Close()
		<-served
	})
	return tr, "http://pipe.test"
}

// Over HTTP/1 and HTTP/2 the loser is canceled (its connection closed,
// its stream reset), the winner is not: its context lives until its body
// is closed, so a body that the server is still writing after the loop
// returned arrives whole, after a retry too, and past the attempt timeout
// (failsafe-go's issues 65 and 123 cancelled it when hedging was combined
// with a retry or a timeout).
func TestTheWinnersBodyOutlivesTheLosersCancellation(t *testing.T) {
	for _, tc := range []struct {
		name          string
		opts          []Option
		loser, winner string // attempt numbers
	}{
		{"a hedge", nil, "1", "2"},
		{"a hedge of a retry, under an attempt timeout",
			[]Option{WithAttemptTimeout(500 * time.Millisecond)}, "2", "3"},
	} {
		for _, proto := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s over HTTP/%d", tc.name, proto), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					winnersBody(t, proto, tc.loser, tc.winner, tc.opts)
				})
			})
		}
	}
}

// winnersBody is TestTheWinnersBodyOutlivesTheLosersCancellation: attempt
// 1 fails with a 503 unless it is the loser; the loser waits until it is
// canceled; the winner sends half its body, then the rest a second after
// the loser was canceled.
func winnersBody(t *testing.T, proto int, loser, winner string, opts []Option) {
	loserCanceled, winnerDone := make(chan struct{}), make(chan struct{})
	var protos sync.Map
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := r.Header.Get(attemptHeader)
		protos.Store(n, r.ProtoMajor)
		switch n {
		case loser:
			<-r.Context().Done()
			close(loserCanceled)
		case winner:
			defer close(winnerDone)
			w.WriteHeader(200)
			io.WriteString(w, "first half, ")
			w.(http.Flusher).Flush()
			<-loserCanceled
			time.Sleep(time.Second) // long after RoundTrip returned
			io.WriteString(w, "second half")
		default:
			w.WriteHeader(503)
		}
	})
	base, url := pipeServer(t, h)
	if proto == 2 {
		base, url = pipeServerH2(t, h)
	}
	tr := newBubbleTransport(base, append([]Option{hedge10ms}, opts...)...)
	resp, err := tr.RoundTrip(get(t, url))
	require.NoError(t, err)
	assert.Equal(t, proto, resp.ProtoMajor)
	b, err := io.ReadAll(resp.Body)
	assert.NoError(t, err, "the winner's body was canceled")
	resp.Body.Close()
	assert.Equal(t, "first half, second half", string(b))
	<-winnerDone
	for _, n := range []string{loser, winner} {
		v, _ := protos.Load(n)
		assert.Equal(t, proto, v, "attempt %s", n)
	}
}

// The caller's cancellation ends every attempt in flight, and no hedge
// starts after it.
func TestTheCallersCancellationEndsAHedgedCall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		slow := planned{after: time.Minute, status: 200}
		p := &plan{answers: map[int]planned{1: slow, 2: slow, 3: slow}}
		base, url := pipeServer(t, p)
		tr := newBubbleTransport(base, hedge10ms)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err := tr.RoundTrip(get(t, url).WithContext(ctx))
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, 15*time.Millisecond, time.Since(start))
		synctest.Wait()
		seen := p.Seen()
		assert.Len(t, seen, 2)
		assert.True(t, seen[1].canceled)
		assert.True(t, seen[2].canceled)
	})
}

// WithPrepare prepares each hedge as any attempt, with its number; a
// hedge whose preparation fails is never sent, ends the call's hedging,
// and leaves the attempt in flight alone.
func TestAHedgeThatCannotBePreparedLeavesTheAttemptInFlight(t *testing.T) {
	var mu sync.Mutex
	var prepared []int
	prep := WithPrepare(func(r *http.Request, attempt int) error {
		mu.Lock()
		defer mu.Unlock()
		prepared = append(prepared, attempt)
		if attempt == 2 {
			return errTokenExpired
		}
		return nil
	})
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{})
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	status, body, _, ev, err := hedgeCall(t, p, getReq(t), prep, WithBudget(bucket),
		WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: 3}))
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 1: 200", body)
	assert.Equal(t, []int{1, 2}, prepared)
	assert.Len(t, p.Seen(), 1)
	assert.Equal(t, map[int]Outcome{1: OutcomeFinal, 2: OutcomeDiscarded}, ev.outcomes())
	assert.ErrorIs(t, ev.done[2].Err, errTokenExpired)
	assert.Equal(t, 500, bucket.Available(time.Now()), "the hedge's cost given back; "+
		"attempt 1's success adds 1, up to the capacity")
	assert.Equal(t, 1, ev.calls[0].Attempts, "the hedge was never sent")
}

// A hedged call keeps the http.RoundTripper contract: the caller's request
// is never modified, every request body (the caller's, and each one GetBody
// gave a hedge) is closed, and so is every response body but the winner's,
// which the caller closes; the bytes of every attempt's body are the
// caller's.
func TestAHedgedCallKeepsTheRoundTripperContract(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &plan{answers: map[int]planned{
			1: {after: time.Second, status: 201},
			2: {after: 15 * time.Millisecond, status: 503},
			3: {after: 10 * time.Millisecond, status: 201},
		}}
		var bodies sync.Map // what each attempt's body was
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			bodies.Store(r.Header.Get(attemptHeader), string(b))
			p.ServeHTTP(w, r)
		})
		base, url := pipeServer(t, h)
		tracker := &closeTracker{base: base}
		tr := newBubbleTransport(tracker,
			WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: 2}))

		var mu sync.Mutex
		var given []*spyBody
		body := &spyBody{Reader: strings.NewReader("amount=10")}
		req, err := http.NewRequest(http.MethodPost, url+"/pay", body)
		require.NoError(t, err)
		req.GetBody = func() (io.ReadCloser, error) {
			b := &spyBody{Reader: strings.NewReader("amount=10")}
			mu.Lock()
			given = append(given, b)
			mu.Unlock()
			return b, nil
		}
		req.Header.Set("X-Trace", "t1")
		before, urlBefore, ctx := req.Header.Clone(), *req.URL, req.Context()

		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		assert.Equal(t, 201, resp.StatusCode)
		b, _ := io.ReadAll(resp.Body)
		assert.Equal(t, "attempt 3: 201", string(b))
		resp.Body.Close()
		synctest.Wait() // the loser and the drain of the discarded 503 end

		assert.Equal(t, before, req.Header, "no key, no attempt header added to the caller's")
		assert.Equal(t, urlBefore, *req.URL)
		assert.Equal(t, ctx, req.Context())
		assert.Equal(t, io.ReadCloser(body), req.Body)
		assert.True(t, body.closed.Load(), "the caller's body is closed")
		mu.Lock()
		require.Len(t, given, 2, "one body per hedge")
		for i, g := range given {
			assert.True(t, g.closed.Load(), "hedge %d's body is closed", i+2)
		}
		mu.Unlock()
		for _, n := range []string{"1", "2", "3"} {
			v, _ := bodies.Load(n)
			assert.Equal(t, "amount=10", v, "attempt %s", n)
		}
		tracker.mu.Lock()
		defer tracker.mu.Unlock()
		require.Len(t, tracker.bodies, 2, "the 503 and the winner; the loser never answered")
		for i, tb := range tracker.bodies {
			assert.True(t, tb.closed.Load(), "response %d closed", i)
		}
	})
}

// A panic of the base transport on a hedge's goroutine is raised again on
// the goroutine of RoundTrip, as it would be without hedging, and the
// attempt in flight is canceled first.
func TestAPanicInAHedgeReachesTheCaller(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
		base, url := pipeServer(t, p)
		panicky := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
			if r.Header.Get(attemptHeader) == "2" {
				panic("base transport bug")
			}
			return base.RoundTrip(r)
		})
		tr := newBubbleTransport(panicky, hedge10ms)
		var got any
		func() {
			defer func() { got = recover() }()
			tr.RoundTrip(get(t, url))
		}()
		assert.Equal(t, "base transport bug", got)
		synctest.Wait()
		assert.True(t, p.Seen()[1].canceled, "the attempt in flight was canceled")
	})
}

// In a full outage whose answers come slowly (every request fails with a
// 503 after 100 ms), every call is hedged at first, and hedges and retries
// spend the same bucket: 35 of them in all (500 tokens, 14 each), then
// every request goes once. The amplification stays that of retries alone.
// The bucket is the AWS SDKs' (RefillTime -1), so that the count is exact;
// the default one adds its refill with time (budget.TokenBucketConfig) to
// hedges and retries alike.
func TestHedgesCannotAmplifyAnOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const calls, workers = 400, 8
		var hits atomic.Int64
		perCall := make([]atomic.Int32, calls)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			i, _ := strconv.Atoi(r.URL.Query().Get("call"))
			perCall[i].Add(1)
			time.Sleep(100 * time.Millisecond)
			w.WriteHeader(http.StatusServiceUnavailable)
		})
		base, url := pipeServer(t, h)
		tr := newBubbleTransport(base, hedge10ms,
			WithBudget(budget.NewRegistry(func() budget.Budget {
				return budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
			})))
		var next atomic.Int64
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for i := next.Add(1) - 1; i < calls; i = next.Add(1) - 1 {
					resp, err := tr.RoundTrip(get(t, url+"/?call="+strconv.Itoa(int(i))))
					require.NoError(t, err)
					resp.Body.Close()
					assert.Equal(t, 503, resp.StatusCode)
				}
			})
		}
		wg.Wait()
		assert.Equal(t, int64(calls+500/14), hits.Load(), "35 hedges and retries in all, then none")
		for i := calls / 2; i < calls; i++ {
			assert.EqualValues(t, 1, perCall[i].Load(), "call %d: once the bucket is dry, one request", i)
		}
	})
}

// An answer set aside and then discarded is drained on a goroutine of its
// own, bounded: a body that stalls is closed after maxPeekTime, and its
// connection with it, while the caller has its winner at once. The drain
// belongs to the body RoundTrip returns: closing it ends the drain, and a
// call that returns no body ends it before it returns.
func TestADiscardedAnswerIsDrainedWithinABound(t *testing.T) {
	for _, tc := range []struct {
		name string
		hold time.Duration // how long the caller keeps the winner's body open
		// closedAfter is when the stalled body's connection is closed,
		// from the return of RoundTrip
		closedAfter time.Duration
	}{
		{"the caller keeps the winner's body open", 5 * time.Second, maxPeekTime},
		{"the caller closes the winner's body at once", 0, 0},
		{"the call ends in an error", -1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { drainCall(t, tc.hold, tc.closedAfter) })
		})
	}
}

// drainCall is TestADiscardedAnswerIsDrainedWithinABound: a hedged call
// whose hedge answers a 503 whose body stalls, which the round discards;
// attempt 1 wins, or (hold < 0) fails with another 503, and the retry
// times out.
func drainCall(t *testing.T, hold, closedAfter time.Duration) {
	closedAt := make(chan time.Time, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get(attemptHeader) {
		case "1":
			time.Sleep(20 * time.Millisecond)
			if hold < 0 {
				w.WriteHeader(503)
			}
			io.WriteString(w, "attempt 1")
		case "2":
			time.Sleep(5 * time.Millisecond)
			w.Header().Set("Content-Length", "1000")
			w.WriteHeader(503)
			io.WriteString(w, "stal")
			w.(http.Flusher).Flush()
			<-r.Context().Done() // the client closed the body: its connection ended
			closedAt <- time.Now()
		default:
			<-r.Context().Done()
		}
	})
	base, url := pipeServer(t, h)
	tr := newBubbleTransport(base, hedge10ms, WithAttemptTimeout(100*time.Millisecond))
	resp, err := tr.RoundTrip(get(t, url))
	returned := time.Now()
	if hold < 0 {
		require.ErrorIs(t, err, ErrAttemptTimeout, "attempt 3")
	} else {
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		assert.Equal(t, "attempt 1", string(b))
		time.Sleep(hold)
		resp.Body.Close()
	}
	select {
	case closed := <-closedAt:
		assert.Equal(t, closedAfter, closed.Sub(returned))
	case <-time.After(time.Minute):
		t.Fatal("the stalled body was never closed")
	}
}

// lateReturn wraps a base transport whose RoundTrip, for a request whose
// context ended, returns a moment after that: the losers of a hedged round
// end then, and RoundTrip returns only once every one of them has ended.
type lateReturn struct {
	base     http.RoundTripper
	inFlight atomic.Int32
}

func (l *lateReturn) RoundTrip(r *http.Request) (*http.Response, error) {
	l.inFlight.Add(1)
	defer l.inFlight.Add(-1)
	resp, err := l.base.RoundTrip(r)
	if r.Context().Err() != nil {
		time.Sleep(time.Millisecond)
	}
	return resp, err
}

// No attempt of a hedged call outlives RoundTrip: the losers are canceled
// and RoundTrip returns once each has ended.
func TestNoLoserOutlivesRoundTrip(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &plan{answers: map[int]planned{1: {after: time.Minute, status: 200}}}
		base, url := pipeServer(t, p)
		late := &lateReturn{base: base}
		tr := newBubbleTransport(late, hedge10ms)
		start := time.Now()
		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err)
		assert.Zero(t, late.inFlight.Load(), "a loser is still in the base transport")
		assert.Equal(t, 11*time.Millisecond, time.Since(start), "the hedge's answer, then the loser's end")
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, "attempt 2: 200", string(b))
	})
}

// A loser that panics while it ends (a base transport's bug) panics on
// the goroutine of RoundTrip, as it would without hedging, never on a
// goroutine of the Transport's own that nothing can recover; the winner's
// body is closed first.
func TestALosersPanicReachesTheCaller(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &plan{answers: map[int]planned{1: {after: time.Minute, status: 200}}}
		base, url := pipeServer(t, p)
		tracker := &closeTracker{base: base}
		panicky := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
			resp, err := tracker.RoundTrip(r)
			if r.Header.Get(attemptHeader) == "1" {
				panic("base transport bug on cancellation")
			}
			return resp, err
		})
		tr := newBubbleTransport(panicky, hedge10ms)
		var got any
		func() {
			defer func() { got = recover() }()
			tr.RoundTrip(get(t, url))
		}()
		assert.Equal(t, "base transport bug on cancellation", got)
		synctest.Wait()
		tracker.mu.Lock()
		defer tracker.mu.Unlock()
		require.Len(t, tracker.bodies, 1, "the winner's answer")
		assert.True(t, tracker.bodies[0].closed.Load(), "the winner's body is closed")
	})
}

// Hedging holds no resources in proportion to the attempt limit: any
// limit, the largest int included, works.
func TestHedgingWithTheLargestAttemptLimit(t *testing.T) {
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 200}}}
	status, body, _, _, err := hedgeCall(t, p, getReq(t), WithMaxAttempts(math.MaxInt),
		WithHedging(Hedging{Delay: 10 * time.Millisecond, MaxHedges: math.MaxInt}))
	require.NoError(t, err)
	assert.Equal(t, 200, status)
	assert.Equal(t, "attempt 2: 200", body)
}

// A hedge is committed as a retry is: when GetBody fails, no hedge is sent,
// the attempt in flight is left alone, and the request is sent no more.
func TestAHedgeWhoseBodyCannotBeRewoundIsNeverSent(t *testing.T) {
	p := &plan{answers: map[int]planned{1: {after: time.Second, status: 503}}}
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
	status, body, took, ev, err := hedgeCall(t, p, func(url string) *http.Request {
		r, err := http.NewRequest(http.MethodPut, url, strings.NewReader("x"))
		require.NoError(t, err)
		r.GetBody = func() (io.ReadCloser, error) { return nil, errTokenExpired }
		return r
	}, hedge10ms, WithBudget(bucket))
	require.NoError(t, err)
	assert.Equal(t, 503, status)
	assert.Equal(t, "attempt 1: 503", body)
	assert.Equal(t, time.Second, took)
	assert.Len(t, p.Seen(), 1)
	assert.False(t, p.Seen()[1].canceled)
	assert.Equal(t, map[int]Outcome{1: OutcomeStopped}, ev.outcomes())
	assert.Equal(t, retry.ReasonBodyNotRewindable, ev.done[1].Stop)
	assert.Equal(t, 500, bucket.Available(time.Now()), "no hedge, no retry: nothing spent")
}

// The caller's cancellation before the hedge delay has passed ends the
// attempt in flight, and no hedge is sent.
func TestTheCallerCancelsDuringTheHedgeDelay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := &plan{answers: map[int]planned{1: {after: time.Minute, status: 200}}}
		base, url := pipeServer(t, p)
		tr := newBubbleTransport(base, hedge10ms)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(5*time.Millisecond, cancel)
		start := time.Now()
		_, err := tr.RoundTrip(get(t, url).WithContext(ctx))
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 5*time.Millisecond, time.Since(start))
		synctest.Wait()
		seen := p.Seen()
		require.Len(t, seen, 1)
		assert.True(t, seen[1].canceled)
	})
}

// The caller's cancellation after the winner's headers, before its body is
// read, ends that body (the caller's context governs it) and the drain of
// the answer the round discarded, at once.
func TestTheCallerCancelsBeforeReadingTheWinnersBody(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		closedAt := make(chan time.Time, 1)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.Header.Get(attemptHeader) {
			case "1":
				time.Sleep(20 * time.Millisecond)
				w.Header().Set("Content-Length", "1000")
				io.WriteString(w, "winner")
				w.(http.Flusher).Flush()
				<-r.Context().Done()
			case "2":
				w.Header().Set("Content-Length", "1000")
				w.WriteHeader(503)
				io.WriteString(w, "stal")
				w.(http.Flusher).Flush()
				<-r.Context().Done()
				closedAt <- time.Now()
			}
		})
		base, url := pipeServer(t, h)
		tr := newBubbleTransport(base, hedge10ms)
		ctx, cancel := context.WithCancel(context.Background())
		resp, err := tr.RoundTrip(get(t, url).WithContext(ctx))
		require.NoError(t, err)
		assert.Equal(t, 200, resp.StatusCode)
		time.Sleep(100 * time.Millisecond)
		canceled := time.Now()
		cancel()
		_, err = io.ReadAll(resp.Body)
		assert.ErrorIs(t, err, context.Canceled)
		resp.Body.Close()
		assert.Equal(t, canceled, <-closedAt, "the drain ended with the caller's context")
		resp.Body.Close() // a second Close does nothing
	})
}

// An answer set aside while another attempt is in flight stays an answer
// until the round ends: when the other attempt then fails at the overall
// deadline, which is also the held answer's time limit, the caller gets
// the held answer, never an error in its place, and can read its body.
func TestAHeldAnswerOutlivesItsTimeLimitWhileTheRoundWaits(t *testing.T) {
	p := &plan{answers: map[int]planned{
		1: {after: time.Minute, status: 200},
		2: {status: 503},
	}}
	status, body, took, ev, err := hedgeCall(t, p, getReq(t), hedge10ms, WithMaxAttempts(2),
		WithMaxElapsed(100*time.Millisecond))
	require.NoError(t, err)
	assert.Equal(t, 503, status)
	assert.Equal(t, "attempt 2: 503", body)
	assert.Equal(t, 100*time.Millisecond, took)
	assert.Equal(t, map[int]Outcome{1: OutcomeDiscarded, 2: OutcomeStopped}, ev.outcomes())
}
