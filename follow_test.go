package saferetry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

var testSecret = bytes.Repeat([]byte("k"), 32)

// chargeServer is a payments API over the idempotency middleware with its
// monitor at /operations/: POST /payments takes charge, then answers 201
// with the charge (ch_1, ch_2, ...), or status when it is set. It records
// the requests the monitor got.
type chargeServer struct {
	mux     *http.ServeMux
	mw      *idempotency.Middleware
	charges atomic.Int64
	mu      sync.Mutex
	polls   []http.Header // the headers of each request to the monitor
}

func newChargeServer(charge time.Duration, status int, opts ...idempotency.Option) *chargeServer {
	s := &chargeServer{mux: http.NewServeMux()}
	s.mw = idempotency.New(memstore.New(), append([]idempotency.Option{
		idempotency.WithLogger(slog.New(slog.DiscardHandler)),
		idempotency.WithMonitor("/operations/", testSecret)}, opts...)...)
	s.mux.Handle("POST /payments", s.mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
		r *http.Request) {
		time.Sleep(charge)
		if status != 0 {
			w.WriteHeader(status)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d"}`, s.charges.Add(1))
	})))
	mon := s.mw.Monitor(s.mux)
	s.mux.Handle("/operations/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.polls = append(s.polls, r.Header.Clone())
		s.mu.Unlock()
		mon.ServeHTTP(w, r)
	}))
	return s
}

func (s *chargeServer) monitorRequests() []http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.polls
}

func payment(t *testing.T, ctx context.Context, url, key string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/payments",
		strings.NewReader(`{"amount":4200}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer acct_1")
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	return req
}

// A charge that takes 4.5 s answers 202 after a second; a Transport that
// follows 202s polls the monitor, honouring its Retry-After, with the
// request's key and credentials, and returns the 201. The polls are not
// attempts: one attempt, nothing taken from the budget, each poll seen
// and logged as a poll.
func TestFollowAcceptedGetsTheFinalResponse(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(4500*time.Millisecond, 0, idempotency.WithAcceptAfter(time.Second))
		base, url := pipeServer(t, srv.mux)
		bucket := budget.NewTokenBucket(budget.TokenBucketConfig{})
		var polls []PollInfo
		var attempts []AttemptDoneInfo
		var done CallDoneInfo
		var logs bytes.Buffer
		tr := NewTransport(base, WithFollowAccepted(true), WithBudget(bucket),
			WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))),
			WithObserver(Observer{
				Poll:        func(_ context.Context, p PollInfo) { polls = append(polls, p) },
				AttemptDone: func(_ context.Context, a AttemptDoneInfo) { attempts = append(attempts, a) },
				CallDone:    func(_ context.Context, c CallDoneInfo) { done = c },
			}))
		tokens := bucket.Available(time.Now())
		start := time.Now()
		resp, err := tr.RoundTrip(payment(t, t.Context(), url, ""))
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, `{"charge":"ch_1"}`, string(body))
		assert.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader))
		assert.Equal(t, 5*time.Second, time.Since(start), "1 s to the 202, then four polls a second apart")
		assert.Equal(t, int64(1), srv.charges.Load())

		require.Len(t, attempts, 1, "a poll is not an attempt")
		assert.Equal(t, http.StatusAccepted, attempts[0].Response.StatusCode)
		assert.Equal(t, 1, done.Attempts)
		assert.Equal(t, http.StatusCreated, done.Response.StatusCode)
		assert.Equal(t, 5*time.Second, done.Total)
		assert.GreaterOrEqual(t, bucket.Available(time.Now()), tokens, "no poll took a token")

		require.Len(t, polls, 4)
		for i, p := range polls[:3] {
			assert.Equal(t, i+1, p.Poll)
			assert.Equal(t, OperationInProgress, p.State)
			assert.Equal(t, time.Second, p.Wait)
			assert.Equal(t, attempts[0].Key, p.Key)
			assert.Contains(t, p.Monitor, "http://pipe.test/operations/")
		}
		assert.Equal(t, OperationCompleted, polls[3].State)
		assert.Zero(t, polls[3].Wait)
		for _, h := range srv.monitorRequests() {
			assert.Equal(t, attempts[0].Key, h.Get("Idempotency-Key"), "the same key")
			assert.Equal(t, "Bearer acct_1", h.Get("Authorization"))
			assert.Empty(t, h.Get("Content-Type"))
			assert.Empty(t, h.Get("Request-Attempt"), "a poll has no attempt number")
		}
		assert.Equal(t, 4, strings.Count(logs.String(), "poll of a 202's monitor"))
		assert.NotContains(t, logs.String(), attempts[0].Key)
	})
}

// Without WithFollowAccepted, the 202 is the answer, an unknown outcome.
func TestFollowAcceptedOffReturnsThe202(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(5*time.Second, 0, idempotency.WithAcceptAfter(time.Second))
		base, url := pipeServer(t, srv.mux)
		resp, err := quietTransport(base).RoundTrip(payment(t, t.Context(), url, "k"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusAccepted, resp.StatusCode)
		assert.NotEmpty(t, resp.Header.Get("Location"))
		assert.False(t, Definitive(resp, nil))
		time.Sleep(5 * time.Second) // the handler's end
	})
}

// The overall deadline ends the following: a *FollowError says the
// operation is still in progress, names the monitor, and never the key.
func TestFollowAcceptedDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(time.Minute, 0, idempotency.WithAcceptAfter(time.Second))
		base, url := pipeServer(t, srv.mux)
		tr := quietTransport(base, WithFollowAccepted(true), WithMaxElapsed(10*time.Second))
		start := time.Now()
		resp, err := tr.RoundTrip(payment(t, t.Context(), url, "order-secret-42"))
		require.Nil(t, resp)
		var fe *FollowError
		require.ErrorAs(t, err, &fe)
		assert.Equal(t, OperationInProgress, fe.State)
		assert.Equal(t, 8, fe.Polls, "one a second from 1 s; none that would end after 10 s")
		assert.Equal(t, "order-secret-42", fe.Key)
		assert.ErrorIs(t, err, errFollowDeadline)
		assert.Contains(t, err.Error(), fe.Monitor)
		assert.NotContains(t, err.Error(), "order-secret-42")
		assert.NotContains(t, fe.Monitor, "order-secret-42")
		assert.Less(t, time.Since(start), 10*time.Second)
		assert.False(t, Definitive(resp, err))
		time.Sleep(time.Minute)
	})
}

// An operation whose handler fails and gives its key up is absent on the
// monitor: the following ends with that, and sending again with the same
// key runs it.
func TestFollowAcceptedAbsent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(2500*time.Millisecond, http.StatusInternalServerError,
			idempotency.WithAcceptAfter(time.Second))
		base, url := pipeServer(t, srv.mux)
		tr := quietTransport(base, WithFollowAccepted(true))
		_, err := tr.RoundTrip(payment(t, t.Context(), url, "k"))
		var fe *FollowError
		require.ErrorAs(t, err, &fe)
		assert.Equal(t, OperationAbsent, fe.State)
		assert.Equal(t, 2, fe.Polls)
		assert.Contains(t, err.Error(), "send the request again with the same key")
	})
}

// monitorScript is a server whose POST answers 202 with a monitor at
// loc, and whose monitor answers the scripted statuses in turn (the last
// one for good); 200 is the replay.
type monitorScript struct {
	loc        string
	retryAfter string
	statuses   []int
	mu         sync.Mutex
	times      []time.Time
}

func (m *monitorScript) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPost {
		w.Header().Set("Location", m.loc)
		w.Header().Set("Retry-After", m.retryAfter)
		w.WriteHeader(http.StatusAccepted)
		return
	}
	m.mu.Lock()
	m.times = append(m.times, time.Now())
	status := m.statuses[min(len(m.times), len(m.statuses))-1]
	m.mu.Unlock()
	switch status {
	case http.StatusOK:
		w.Header().Set(idempotency.ReplayedHeader, "true")
		io.WriteString(w, "done")
	case http.StatusAccepted:
		w.Header().Set("Retry-After", m.retryAfter)
		w.WriteHeader(status)
	default:
		w.WriteHeader(status)
	}
}

// A monitor's unknown answers (503, 502) are polled again; Retry-After is
// honoured up to WithMaxRetryAfter; a 202 whose monitor is on another
// origin is returned as it is; a monitor that answers what no monitor
// answers stops the following.
func TestFollowAcceptedPolls(t *testing.T) {
	t.Run("unknown answers polled again, Retry-After capped", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			m := &monitorScript{loc: "/op/1", retryAfter: "100",
				statuses: []int{503, 202, 502, 200}}
			base, url := pipeServer(t, m)
			tr := quietTransport(base, WithFollowAccepted(true),
				WithMaxRetryAfter(3*time.Second), WithMaxElapsed(time.Minute))
			start := time.Now()
			resp, err := tr.RoundTrip(payment(t, t.Context(), url, "k"))
			require.NoError(t, err)
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			assert.Equal(t, "done", string(b))
			require.Len(t, m.times, 4)
			assert.Equal(t, 3*time.Second, m.times[0].Sub(start), "Retry-After 100 s capped at 3 s")
			assert.Equal(t, time.Second, m.times[1].Sub(m.times[0]), "a 503 without Retry-After: 1 s")
			assert.Equal(t, 3*time.Second, m.times[2].Sub(m.times[1]))
			assert.Equal(t, time.Second, m.times[3].Sub(m.times[2]))
		})
	})
	t.Run("another origin", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			m := &monitorScript{loc: "http://elsewhere.test/op/1", retryAfter: "1",
				statuses: []int{200}}
			base, url := pipeServer(t, m)
			resp, err := quietTransport(base, WithFollowAccepted(true)).
				RoundTrip(payment(t, t.Context(), url, "k"))
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, http.StatusAccepted, resp.StatusCode)
			assert.Empty(t, m.times, "credentials never go to another origin")
		})
	})
	t.Run("not a monitor", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			m := &monitorScript{loc: "/op/1", retryAfter: "1", statuses: []int{202, 403}}
			base, url := pipeServer(t, m)
			_, err := quietTransport(base, WithFollowAccepted(true)).
				RoundTrip(payment(t, t.Context(), url, "k"))
			var fe *FollowError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, OperationInProgress, fe.State)
			assert.Equal(t, 2, fe.Polls)
			assert.Contains(t, err.Error(), "the monitor answered 403")
		})
	})
	t.Run("canceled", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			m := &monitorScript{loc: "/op/1", retryAfter: "1", statuses: []int{202}}
			base, url := pipeServer(t, m)
			ctx, cancel := context.WithTimeout(t.Context(), 2500*time.Millisecond)
			defer cancel()
			_, err := quietTransport(base, WithFollowAccepted(true), WithMaxElapsed(0)).
				RoundTrip(payment(t, ctx, url, "k"))
			var fe *FollowError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, 2, fe.Polls, "at 1 s and 2 s; none that would end after the context's 2.5 s")
			assert.True(t, errors.Is(err, errFollowDeadline))
		})
	})
}
