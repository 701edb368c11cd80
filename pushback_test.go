package saferetry

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/retry"
)

// Header names of docs/CONTRACT.md, spelled out: a test of the wire.
const (
	attemptHeader = "Request-Attempt"
	markHeader    = "Retried-Below"
)

func TestEveryAttemptCarriesItsNumber(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   []Option
		caller string   // the caller's own Request-Attempt, "" for none
		want   []string // on attempts 1 to 3, "" for absent
	}{
		{name: "default", want: []string{"1", "2", "3"}},
		{name: "the caller's value is replaced", caller: "7", want: []string{"1", "2", "3"}},
		{name: "with the deadline header", opts: []Option{WithDeadlineHeader(true)}, want: []string{"1", "2", "3"}},
		{name: "with a preparation", opts: []Option{WithPrepare(func(*http.Request, int) error { return nil })},
			want: []string{"1", "2", "3"}},
		{name: "off", opts: []Option{WithAttemptHeader(false)}, want: []string{"", "", ""}},
		{name: "off keeps the caller's", caller: "7", opts: []Option{WithAttemptHeader(false)},
			want: []string{"7", "7", "7"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := &script{statuses: []int{503, 502, 200}}
				base, url := pipeServer(t, srv)
				req := post(t, context.Background(), url, "{}") // an automatic key: its own header map
				get := get(t, url)
				if tc.caller != "" {
					req.Header.Set(attemptHeader, tc.caller)
					get.Header.Set(attemptHeader, tc.caller)
				}
				before, beforeGet := req.Header.Clone(), get.Header.Clone()
				for _, r := range []*http.Request{req, get} {
					resp, err := newBubbleTransport(base, tc.opts...).RoundTrip(r)
					require.NoError(t, err)
					resp.Body.Close()
					assert.Equal(t, 200, resp.StatusCode)
				}
				hits := srv.Hits()
				require.Len(t, hits, 4) // 503, 502, 200 for the POST; the GET's 200
				for i, h := range hits[:3] {
					assert.Equal(t, tc.want[i], h.header.Get(attemptHeader), "attempt %d", i+1)
					assert.Len(t, h.header.Values(attemptHeader), min(1, len(tc.want[i])), "one field line")
				}
				assert.Equal(t, tc.want[0], hits[3].header.Get(attemptHeader), "a GET's first attempt")
				assert.Equal(t, before, req.Header, "the caller's request is never modified")
				assert.Equal(t, beforeGet, get.Header)
			})
		})
	}
}

// markedScript answers status with the mark.
func markedScript(status int) *script {
	return &script{statuses: []int{status, 200}, header: func(_ int, h http.Header) {
		h.Set(markHeader, "true")
	}}
}

// A marked answer is never retried, whatever the rules: the stop reason is
// retry.ReasonRetriedBelow, and the answer is returned as it is.
func TestAMarkedAnswerIsNeverRetried(t *testing.T) {
	for _, status := range []int{503, 502, 429, 500} {
		synctest.Test(t, func(t *testing.T) {
			srv := markedScript(status)
			base, url := pipeServer(t, srv)
			var done CallDoneInfo
			tr := newBubbleTransport(base, WithRetryPolicy(retry.Status(retry.Allow, status)),
				WithObserver(Observer{CallDone: func(_ context.Context, i CallDoneInfo) { done = i }}))
			resp, err := tr.RoundTrip(get(t, url))
			require.NoError(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			assert.Equal(t, status, resp.StatusCode)
			assert.Equal(t, "answer "+http.StatusText(status), string(body))
			assert.Len(t, srv.Hits(), 1, "status %d", status)
			assert.Equal(t, retry.ReasonRetriedBelow, done.Stop)
			assert.Equal(t, OutcomeStopped, done.Outcome)
		})
	}
	// The mark on an in-progress conflict, which is retried, is no mark:
	// the mark means something only on a 5xx or 429 answer.
	synctest.Test(t, func(t *testing.T) {
		var n atomic.Int32
		base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set(markHeader, "true")
			if n.Add(1) == 1 {
				w.Header().Set("Content-Type", "application/problem+json")
				w.WriteHeader(http.StatusConflict)
				io.WriteString(w, `{"status":409,"code":"idempotency_request_in_progress"}`)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
		resp, err := newBubbleTransport(base).RoundTrip(post(t, context.Background(), url, "{}"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, int32(2), n.Load(), "the in-progress conflict was retried")
	})
	// Without the mark, the same rules retry it.
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{500, 200}, header: func(_ int, h http.Header) { h.Set(markHeader, "no") }}
		base, url := pipeServer(t, srv)
		resp, err := newBubbleTransport(base, WithRetryPolicy(retry.Status(retry.Allow, 500))).RoundTrip(get(t, url))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 200, resp.StatusCode)
		assert.Len(t, srv.Hits(), 2, "a value other than true is not the mark")
	})
}

// front serves one request behind deadline.Middleware: its handler calls
// url with tr (with the request's context, as handlers do), then answers
// status whatever the call's outcome. It returns the front's answer.
func front(t *testing.T, tr *Transport, url string, status int) *httptest.ResponseRecorder {
	t.Helper()
	h := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		out, err := http.NewRequestWithContext(r.Context(), http.MethodGet, url, nil)
		require.NoError(t, err)
		if resp, err := tr.RoundTrip(out); err == nil {
			resp.Body.Close()
		}
		w.WriteHeader(status)
	}))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	return rec
}

// A call made for a request served behind deadline.Middleware notes in its
// record when its failure was retried (decide.PushBack), here or below; the
// middleware then marks the request's own 5xx or 429 answer.
func TestACallThatGaveUpMarksTheAnswerAbove(t *testing.T) {
	for _, tc := range []struct {
		name   string
		srv    func() *script
		opts   []Option
		status int // the front's answer
		marked bool
	}{
		{name: "attempts used up", srv: func() *script { return &script{statuses: []int{503}} }, status: 503,
			marked: true},
		{name: "attempts used up, answered 429", srv: func() *script { return &script{statuses: []int{502}} },
			status: 429, marked: true},
		{name: "attempts used up, answered 500", srv: func() *script { return &script{statuses: []int{504}} },
			status: 500, marked: true},
		{name: "attempts used up, answered 404", srv: func() *script { return &script{statuses: []int{503}} },
			status: 404},
		{name: "a single attempt allowed: nothing was retried",
			srv: func() *script { return &script{statuses: []int{503}} }, opts: []Option{WithMaxAttempts(1)},
			status: 503},
		{name: "budget refused", srv: func() *script { return &script{statuses: []int{503}} },
			opts:   []Option{WithBudget(budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 10}))},
			status: 503, marked: true},
		{name: "no time for the retry", srv: func() *script {
			return &script{statuses: []int{503}, header: func(_ int, h http.Header) { h.Set("Retry-After", "60") }}
		}, status: 503, marked: true},
		{name: "a marked answer, with a single attempt", srv: func() *script { return markedScript(503) },
			opts: []Option{WithMaxAttempts(1)}, status: 503, marked: true},
		{name: "a marked answer that is not retryable", srv: func() *script { return markedScript(500) },
			status: 503, marked: true},
		{name: "a failure that is not retryable", srv: func() *script { return &script{statuses: []int{500}} },
			status: 503},
		{name: "the mark on a 404 is no mark", srv: func() *script { return markedScript(404) }, status: 502},
		{name: "the mark on a success is no mark", srv: func() *script { return markedScript(200) },
			status: 500},
		{name: "a success after a retry", srv: func() *script { return &script{statuses: []int{503, 200}} },
			status: 503},
		{name: "retried, then a failure that is not retryable",
			srv: func() *script { return &script{statuses: []int{503, 503, 500}} }, status: 502, marked: true},
		{name: "retried, then a 404", srv: func() *script { return &script{statuses: []int{503, 404}} },
			status: 502},
		{name: "retried, then a 429 not retried",
			srv:  func() *script { return &script{statuses: []int{503, 429}} },
			opts: []Option{WithRetryPolicy(retry.Status(retry.Deny, 429))}, status: 503, marked: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				base, url := pipeServer(t, tc.srv())
				rec := front(t, newBubbleTransport(base, tc.opts...), url, tc.status)
				want := ""
				if tc.marked {
					want = "true"
				}
				assert.Equal(t, want, rec.Header().Get(markHeader))
			})
		})
	}
}

// A call that never got an answer (the service below refused every
// connection) and gave up after retrying marks the answer above too.
func TestAnUnreachableServiceBelowMarksTheAnswerAbove(t *testing.T) {
	rec := front(t, newTestTransport(nil), closedPort(t), 502)
	assert.Equal(t, 502, rec.Code)
	assert.Equal(t, "true", rec.Header().Get(markHeader))
}

// A call that the handler's own deadline cancels while its retry is in
// flight was retried: the answer above is marked.
func TestACallCanceledAfterRetryingMarksTheAnswerAbove(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var hits atomic.Int32
		base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if hits.Add(1) > 1 { // the retry: slower than the handler above waits
				<-r.Context().Done()
				return
			}
			w.WriteHeader(503)
		}))
		var stop retry.Reason
		tr := newBubbleTransport(base, WithObserver(Observer{
			CallDone: func(_ context.Context, i CallDoneInfo) { stop = i.Stop }}))
		h := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), time.Second)
			defer cancel()
			out, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			_, err := tr.RoundTrip(out)
			require.Error(t, err)
			w.WriteHeader(503)
		}))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		assert.Equal(t, int32(2), hits.Load())
		assert.Equal(t, retry.ReasonCanceled, stop)
		assert.Equal(t, "true", rec.Header().Get(markHeader))
	})
}

// Without deadline.Middleware there is no record: the call notes nothing
// and nothing is marked.
func TestWithoutTheMiddlewareNothingIsMarked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base, url := pipeServer(t, &script{statuses: []int{503}})
		tr := newBubbleTransport(base)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			out, _ := http.NewRequestWithContext(r.Context(), http.MethodGet, url, nil)
			resp, err := tr.RoundTrip(out)
			require.NoError(t, err)
			resp.Body.Close()
			w.WriteHeader(resp.StatusCode)
		})
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		assert.Equal(t, 503, rec.Code)
		assert.Empty(t, rec.Header().Values(markHeader))
	})
}

// The attempt number a Transport sends is what deadline.Attempt returns to
// the handler behind deadline.Middleware.
func TestTheHandlerSeesTheAttemptNumber(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var seen []string
		h := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := deadline.Attempt(r.Context())
			seen = append(seen, strconv.Itoa(n))
			if n < 3 {
				w.WriteHeader(503)
			}
		}))
		base, url := pipeServer(t, h)
		resp, err := newBubbleTransport(base).RoundTrip(get(t, url))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, []string{"1", "2", "3"}, seen)
		resp, err = newBubbleTransport(base, WithAttemptHeader(false), WithMaxAttempts(1)).RoundTrip(get(t, url))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, "0", seen[3], "no attempt header: unknown")
	})
}
