package saferetry

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// hit is what the test server saw of one attempt.
type hit struct {
	at     time.Time // when the server saw it
	method string
	key    string
	keys   int
	body   []byte
	header http.Header
}

// script is a test server answering with the given statuses in order (the
// last one repeats), recording every hit.
type script struct {
	mu       sync.Mutex
	hits     []hit
	statuses []int
	header   func(n int, h http.Header)
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	n := len(s.hits)
	s.hits = append(s.hits, hit{at: time.Now(), method: r.Method, key: r.Header.Get("Idempotency-Key"),
		keys: len(r.Header.Values("Idempotency-Key")), body: body, header: r.Header.Clone()})
	status := s.statuses[min(n, len(s.statuses)-1)]
	s.mu.Unlock()
	if s.header != nil {
		s.header(n, w.Header())
	}
	w.WriteHeader(status)
	io.WriteString(w, "answer "+http.StatusText(status))
}

func (s *script) Hits() []hit {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]hit(nil), s.hits...)
}

// Waits returns the time between consecutive hits: in a synctest bubble,
// where time advances only while every goroutine waits, exactly the
// Transport's sleeps.
func (s *script) Waits() []time.Duration {
	hits := s.Hits()
	var waits []time.Duration
	for i := 1; i < len(hits); i++ {
		waits = append(waits, hits[i].at.Sub(hits[i-1].at))
	}
	return waits
}

// halfJitter is full jitter with the random value fixed at 0.5, so that
// every wait is exactly half of its bound.
func halfJitter(attempt int, prev, base, cap time.Duration, _ float64) time.Duration {
	return jitter.Full(attempt, prev, base, cap, 0.5)
}

// fastWaits shrinks the backoff of tests on the real clock (outside a
// synctest bubble), so that their retries sleep microseconds; the tests of
// the waits themselves run in a bubble, with the default bases.
var fastWaits = WithBackoff(jitter.Config{Func: halfJitter, Base: time.Microsecond,
	ThrottleBase: time.Microsecond, Cap: time.Microsecond})

// newTestTransport builds a Transport with short waits, half jitter, an
// unlimited budget and no logs unless opts say otherwise.
func newTestTransport(base http.RoundTripper, opts ...Option) *Transport {
	all := append([]Option{fastWaits, WithBudget(budget.Unlimited()), WithLogger(nil)}, opts...)
	return NewTransport(base, all...)
}

// newBubbleTransport is newTestTransport with the default bases and cap,
// for tests inside a synctest bubble, whose fake clock makes every wait
// instant and exact.
func newBubbleTransport(base http.RoundTripper, opts ...Option) *Transport {
	return newTestTransport(base, append([]Option{WithBackoff(jitter.Config{Func: halfJitter})}, opts...)...)
}

// closeTracker wraps a base transport and records whether each response
// body it handed out was closed.
type closeTracker struct {
	base   http.RoundTripper
	mu     sync.Mutex
	bodies []*trackedBody
}

type trackedBody struct {
	io.ReadCloser
	closed atomic.Bool
}

func (b *trackedBody) Close() error { b.closed.Store(true); return b.ReadCloser.Close() }

func (c *closeTracker) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	tb := &trackedBody{ReadCloser: resp.Body}
	resp.Body = tb
	c.mu.Lock()
	c.bodies = append(c.bodies, tb)
	c.mu.Unlock()
	return resp, nil
}

func get(t *testing.T, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	return req
}

func TestRetriesTransientStatusesAndClosesDiscardedBodies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503, 503, 200}}
		base, url := pipeServer(t, srv)
		tracker := &closeTracker{base: base}
		tr := newBubbleTransport(tracker)

		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		require.NoError(t, resp.Body.Close())

		assert.Equal(t, 200, resp.StatusCode)
		assert.Equal(t, "answer OK", string(body))
		assert.Len(t, srv.Hits(), 3)
		require.Len(t, tracker.bodies, 3)
		assert.True(t, tracker.bodies[0].closed.Load(), "first discarded body closed")
		assert.True(t, tracker.bodies[1].closed.Load(), "second discarded body closed")
		// Full jitter with r = 0.5: 25 ms then 50 ms.
		assert.Equal(t, []time.Duration{25 * time.Millisecond, 50 * time.Millisecond}, srv.Waits())
	})
}

func TestStatusesOutsideTheAllowListAreNotRetried(t *testing.T) {
	for _, status := range []int{400, 401, 403, 404, 409, 422, 501, 500} {
		synctest.Test(t, func(t *testing.T) {
			srv := &script{statuses: []int{status, 200}}
			base, url := pipeServer(t, srv)
			tr := newBubbleTransport(base)
			start := time.Now()
			resp, err := tr.RoundTrip(get(t, url))
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, status, resp.StatusCode)
			assert.Len(t, srv.Hits(), 1, "status %d", status)
			assert.Zero(t, time.Since(start), "status %d: no sleep", status)
		})
	}
}

func TestRetry500IsOptIn(t *testing.T) {
	srv := &script{statuses: []int{500}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil, WithRetryPolicy(retry.Status(retry.Allow, 500)))
	resp, err := tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err, "a response is returned with a nil error")
	resp.Body.Close()
	assert.Equal(t, 500, resp.StatusCode)
	assert.Len(t, srv.Hits(), 3)
}

func TestRetryAfterIsHonoured(t *testing.T) {
	cases := map[string]func(now time.Time) string{
		"delta-seconds": func(time.Time) string { return "2" },
		"http-date":     func(now time.Time) string { return now.Add(2 * time.Second).UTC().Format(http.TimeFormat) },
	}
	for name, value := range cases {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				// A bubble's clock starts at a whole second, so an
				// HTTP-date (second resolution) 2 s ahead means exactly 2 s.
				require.Zero(t, time.Now().Nanosecond())
				srv := &script{statuses: []int{429, 200}}
				srv.header = func(n int, h http.Header) {
					if n == 0 {
						h.Set("Retry-After", value(time.Now()))
					}
				}
				base, url := pipeServer(t, srv)
				tr := newBubbleTransport(base)
				resp, err := tr.RoundTrip(get(t, url))
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, 200, resp.StatusCode)
				require.Len(t, srv.Waits(), 1)
				assert.GreaterOrEqual(t, srv.Waits()[0], 2*time.Second)
			})
		})
	}
}

func TestRetryAfterAboveTheCapReturnsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{429, 200}, header: func(_ int, h http.Header) { h.Set("Retry-After", "3600") }}
		base, url := pipeServer(t, srv)
		var done CallDoneInfo
		tr := newBubbleTransport(base, WithObserver(Observer{
			CallDone: func(_ context.Context, info CallDoneInfo) { done = info },
		}))
		start := time.Now()
		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 429, resp.StatusCode)
		assert.Len(t, srv.Hits(), 1)
		assert.Zero(t, time.Since(start), "no sleep at all")
		assert.Equal(t, retry.ReasonRetryAfterTooLong, done.Stop, "not the deadline: WithMaxRetryAfter")
	})
}

// startClock is a base RoundTripper that records when the last attempt
// was handed to it: the client's clock, which a loaded machine's scheduling
// of the server's goroutines cannot move.
type startClock struct {
	base      http.RoundTripper
	lastStart atomic.Int64
}

func (s *startClock) RoundTrip(r *http.Request) (*http.Response, error) {
	s.lastStart.Store(time.Now().UnixNano())
	return s.base.RoundTrip(r)
}

func TestContextDeadlineBoundsTheWholeLoop(t *testing.T) {
	release := make(chan struct{})
	var hits atomic.Int32
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer ts.Close()
	defer close(release)
	base := &startClock{base: http.DefaultTransport}
	lastStart := &base.lastStart
	tr := NewTransport(base, WithBudget(budget.Unlimited()), WithLogger(slog.New(slog.DiscardHandler)),
		WithAttemptTimeout(100*time.Millisecond))

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	dl, _ := ctx.Deadline()
	start := time.Now()
	resp, err := tr.RoundTrip(get(t, ts.URL).WithContext(ctx))
	elapsed := time.Since(start)
	require.Error(t, err)
	assert.Nil(t, resp)
	assert.ErrorIs(t, err, retry.ErrExhausted)
	assert.Less(t, elapsed, 300*time.Millisecond+150*time.Millisecond, "returned within the deadline plus a margin")
	assert.GreaterOrEqual(t, int(hits.Load()), 1)
	assert.False(t, time.Unix(0, lastStart.Load()).After(dl), "no attempt started after the deadline")
}

func TestCallerDeadlineErrorIsAContextError(t *testing.T) {
	release := make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer ts.Close()
	defer close(release)
	var last AttemptDoneInfo
	tr := NewTransport(nil, WithBudget(budget.Unlimited()), WithLogger(slog.New(slog.DiscardHandler)),
		WithObserver(Observer{AttemptDone: func(_ context.Context, info AttemptDoneInfo) { last = info }}))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := tr.RoundTrip(get(t, ts.URL).WithContext(ctx))
	assert.Less(t, time.Since(start), 450*time.Millisecond)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	var ex *retry.ExhaustedError
	require.ErrorAs(t, err, &ex)
	assert.Equal(t, 1, ex.Attempts)
	assert.Equal(t, retry.ReasonCanceled, ex.Reason)
	assert.Equal(t, retry.ClassCallerDeadline, last.Decision.Class)
	assert.Equal(t, retry.Class("caller_deadline"), last.Decision.Class, "not the overall deadline's")
}

// hangingServer accepts requests and never answers until the test ends.
func hangingServer(t *testing.T) (*httptest.Server, *atomic.Int32) {
	release := make(chan struct{})
	var hits atomic.Int32
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); ts.Close() })
	return ts, &hits
}

func post(t *testing.T, ctx context.Context, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	return req
}

func TestUnsafePostWithoutKeyIsNotRetriedOnReadTimeout(t *testing.T) {
	ts, hits := hangingServer(t)
	tr := newTestTransport(nil, WithAutoKeys(false), WithAttemptTimeout(50*time.Millisecond))
	_, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "pay 10"))
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrAttemptTimeout)
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "the attempt's own limit is not the caller's deadline")
	assert.NotErrorIs(t, err, context.Canceled, "nor the caller's cancellation")
	assert.Equal(t, int32(1), hits.Load(), "a POST without a key is never retried after it may have arrived")
}

// closedPort returns an address nothing listens on.
func closedPort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

func TestUnsafePostWithoutKeyIsRetriedWhenConnectionRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		url := closedPort(t)
		base := &http.Transport{}
		defer base.CloseIdleConnections()
		tr := newBubbleTransport(base, WithAutoKeys(false))
		start := time.Now()
		_, err := tr.RoundTrip(post(t, context.Background(), url, "pay 10"))
		require.Error(t, err)
		var ex *retry.ExhaustedError
		require.ErrorAs(t, err, &ex)
		assert.Equal(t, 3, ex.Attempts, "a refused connection never carried the request: retried")
		assert.Equal(t, retry.ReasonMaxAttempts, ex.Reason)
		assert.Equal(t, 25*time.Millisecond+50*time.Millisecond, time.Since(start), "two sleeps")
	})
}

func TestExhaustedErrorWrapsTheRootCause(t *testing.T) {
	url := closedPort(t)
	tr := newTestTransport(nil)
	_, err := tr.RoundTrip(get(t, url))
	require.Error(t, err)
	assert.ErrorIs(t, err, retry.ErrExhausted)
	assert.ErrorIs(t, err, syscall.ECONNREFUSED)
	var ex *retry.ExhaustedError
	require.ErrorAs(t, err, &ex)
	assert.Equal(t, 3, ex.Attempts)
	assert.Contains(t, err.Error(), "3 attempts")
}

func TestEveryAttemptCarriesIdenticalBodyBytes(t *testing.T) {
	payload := strings.Repeat(`{"amount":1000,"currency":"EUR"}`, 100)
	bodies := map[string]func(url string) *http.Request{
		"GetBody": func(url string) *http.Request { // strings.Reader: net/http sets GetBody
			return post(t, context.Background(), url, payload)
		},
		"buffered": func(url string) *http.Request { // a plain reader: no GetBody
			req, err := http.NewRequest(http.MethodPost, url, io.NopCloser(io.MultiReader(strings.NewReader(payload))))
			require.NoError(t, err)
			require.Nil(t, req.GetBody)
			return req
		},
	}
	for name, mk := range bodies {
		t.Run(name, func(t *testing.T) {
			srv := &script{statuses: []int{503, 502, 201}}
			ts := httptest.NewServer(srv)
			defer ts.Close()
			tr := newTestTransport(nil)
			resp, err := tr.RoundTrip(mk(ts.URL))
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, 201, resp.StatusCode)
			hits := srv.Hits()
			require.Len(t, hits, 3)
			for i, h := range hits {
				assert.Equal(t, payload, string(h.body), "attempt %d body", i+1)
			}
		})
	}
}

func TestBodyAboveBufferLimitIsSentOnceWithoutRetry(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil, WithMaxBufferedBody(10))
	req, err := http.NewRequest(http.MethodPost, ts.URL, io.NopCloser(strings.NewReader("0123456789ABCDEF")))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 503, resp.StatusCode, "the 503 is returned: the body cannot be replayed")
	hits := srv.Hits()
	require.Len(t, hits, 1)
	assert.Equal(t, "0123456789ABCDEF", string(hits[0].body), "streamed whole")
}

// spyBody records whether the caller's body was closed.
type spyBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *spyBody) Close() error { b.closed.Store(true); return nil }

func TestCallersRequestIsNeverModified(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)

	type ctxKey struct{}
	ctx := context.WithValue(context.Background(), ctxKey{}, "mine")
	body := &spyBody{Reader: strings.NewReader("hello")}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+"/pay?x=1", body)
	require.NoError(t, err)
	req.Header.Set("X-Trace", "t1")
	before := req.Header.Clone()
	urlBefore := *req.URL

	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()

	assert.Equal(t, before, req.Header, "headers unchanged: no key, no deadline header added")
	assert.Empty(t, req.Header.Get("Idempotency-Key"))
	assert.Equal(t, urlBefore, *req.URL)
	assert.Same(t, ctx, req.Context())
	assert.Same(t, body, req.Body, "body field unchanged")
	assert.True(t, body.closed.Load(), "the caller's body is closed, as the RoundTripper contract says")
	// The key the server saw is visible on resp.Request.
	hits := srv.Hits()
	require.Len(t, hits, 2)
	assert.Equal(t, hits[0].key, resp.Request.Header.Get("Idempotency-Key"))
}

func TestRequestBodyClosedOnEarlyError(t *testing.T) {
	tr := newTestTransport(nil)
	body := &spyBody{Reader: strings.NewReader("x")}
	req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/", body)
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "has space")
	_, err = tr.RoundTrip(req)
	require.Error(t, err)
	assert.True(t, body.closed.Load())
}

func TestSharedTransportUnderConcurrency(t *testing.T) {
	// The first attempt of every other logical request (told apart by its
	// key) fails with 503; the retry succeeds.
	var mu sync.Mutex
	seen := map[string]int{}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		seen[key]++
		first := seen[key] == 1 && len(seen)%2 == 0
		mu.Unlock()
		if first {
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(200)
	}))
	defer ts.Close()
	tr := newTestTransport(nil)
	client := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	var ok atomic.Int32
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 10; i++ {
				resp, err := client.Post(ts.URL, "text/plain", strings.NewReader("x"))
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 {
					ok.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, int32(640), ok.Load(), "every logical request succeeds after at most one retry")
	assert.Len(t, seen, 640, "one key per logical request, reused by its retry")
}

// recordingHandler keeps every log record.
type recordingHandler struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.records = append(h.records, r.Clone())
	h.mu.Unlock()
	return nil
}
func (h *recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordingHandler) WithGroup(string) slog.Handler      { return h }

func attrs(r slog.Record) map[string]slog.Value {
	m := map[string]slog.Value{}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value; return true })
	return m
}

func TestOneLogRecordPerAttempt(t *testing.T) {
	srv := &script{statuses: []int{503, 503, 503}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	h := &recordingHandler{}
	tr := newTestTransport(nil, WithLogger(slog.New(h)))
	const key = "order-confirm-42-secret"
	req := post(t, context.Background(), ts.URL+"/pay?card=4242", "x")
	req.Header.Set("Idempotency-Key", key)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()

	require.Len(t, h.records, 3)
	wantLevels := []slog.Level{slog.LevelInfo, slog.LevelInfo, slog.LevelWarn}
	for i, r := range h.records {
		a := attrs(r)
		assert.Equal(t, wantLevels[i], r.Level, "record %d", i)
		assert.Equal(t, int64(i+1), a["attempt"].Int64())
		assert.Equal(t, "POST", a["method"].String())
		assert.Equal(t, strings.TrimPrefix(ts.URL, "http://"), a["host"].String())
		assert.Equal(t, "/pay", a["path"].String(), "path without query")
		assert.Equal(t, int64(503), a["status"].Int64())
		assert.Equal(t, "status_503", a["class"].String())
		assert.Contains(t, a, "elapsed")
		assert.Equal(t, keygen.Digest(key), a["key_digest"].String())
		if i < 2 {
			assert.Contains(t, a, "wait")
			assert.Equal(t, "retry", a["outcome"].String())
		} else {
			assert.Equal(t, "stopped", a["outcome"].String())
			assert.Equal(t, "max_attempts", a["stop"].String())
		}
		for _, k := range []string{"class", "outcome", "stop"} {
			if v, ok := a[k]; ok {
				assert.Regexp(t, `^[a-z0-9]+(_[a-z0-9]+)*$`, v.String(), "%s is snake_case", k)
			}
		}
		for _, v := range a {
			assert.NotContains(t, v.String(), key, "the raw key never appears")
			assert.NotContains(t, v.String(), "4242", "the query never appears")
		}
		assert.NotContains(t, r.Message, key)
	}
}

func TestFirstTrySuccessLogsAtDebug(t *testing.T) {
	srv := &script{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	h := &recordingHandler{}
	tr := newTestTransport(nil, WithLogger(slog.New(h)))
	resp, err := tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()
	require.Len(t, h.records, 1)
	assert.Equal(t, slog.LevelDebug, h.records[0].Level)
}

func TestOneGeneratedKeyReusedAcrossRetries(t *testing.T) {
	srv := &script{statuses: []int{503, 503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	req := post(t, context.Background(), ts.URL, "x")
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()

	hits := srv.Hits()
	require.Len(t, hits, 3)
	key := hits[0].key
	u, err := uuid.Parse(key)
	require.NoError(t, err, "a valid UUID")
	assert.Equal(t, uuid.Version(4), u.Version())
	for _, h := range hits {
		assert.Equal(t, key, h.key)
		assert.Equal(t, 1, h.keys)
	}
	assert.Empty(t, req.Header.Values("Idempotency-Key"), "the caller's request has no key added")
	assert.Equal(t, key, resp.Request.Header.Get("Idempotency-Key"), "visible on resp.Request")
}

func TestCallerKeyArrivesByteIdentical(t *testing.T) {
	srv := &script{statuses: []int{502, 504, 201}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	// A quoted sf-string (it needs quoting: it holds '"', ',' and '\\') is
	// sent exactly as the caller wrote it.
	const key = `"order-confirm-42~!\"#$%&'()*+,./:;<=>?@[\\]^_{|}"`
	req := post(t, context.Background(), ts.URL, "x")
	req.Header.Set("Idempotency-Key", key)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	for _, h := range srv.Hits() {
		assert.Equal(t, key, h.key)
	}
	assert.Len(t, srv.Hits(), 3)
}

func TestKeyFromContextIsUsed(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	ctx := keygen.NewContext(context.Background(), keygen.Event("order-confirm", "42"))
	resp, err := tr.RoundTrip(post(t, ctx, ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
	for _, h := range srv.Hits() {
		assert.Equal(t, "order-confirm-42", h.key)
	}
}

func TestContextKeyNeedingQuotesIsSentAsAString(t *testing.T) {
	srv := &script{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	ctx := keygen.NewContext(context.Background(), `tenant,7`)
	resp, err := tr.RoundTrip(post(t, ctx, ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
	raw := srv.Hits()[0].key
	assert.Equal(t, `"tenant,7"`, raw)
	got, err := keygen.ParseHeader([]string{raw})
	require.NoError(t, err)
	assert.Equal(t, "tenant,7", got)
}

func TestConcurrentLogicalPostsGetDistinctKeys(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
	}))
	defer ts.Close()
	tr := newTestTransport(nil)
	client := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := 0; i < 1000; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := client.Post(ts.URL, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
		}()
	}
	wg.Wait()
	assert.Len(t, seen, 1000)
	assert.NotContains(t, seen, "")
}

func TestInvalidCallerKeysFailBeforeAnyIO(t *testing.T) {
	var hits atomic.Int32
	ts := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { hits.Add(1) }))
	defer ts.Close()
	tr := newTestTransport(nil)
	for name, set := range map[string]func(h http.Header){
		"256 chars":  func(h http.Header) { h.Set("Idempotency-Key", strings.Repeat("secret", 43)) },
		"empty":      func(h http.Header) { h.Set("Idempotency-Key", "") },
		"tab":        func(h http.Header) { h.Set("Idempotency-Key", "secret\tb") },
		"control":    func(h http.Header) { h.Set("Idempotency-Key", "secret\x01b") },
		"non-ASCII":  func(h http.Header) { h.Set("Idempotency-Key", "secret-caf\u00e9") },
		"twice":      func(h http.Header) { h.Add("Idempotency-Key", "secret-a"); h.Add("Idempotency-Key", "secret-b") },
		"bad escape": func(h http.Header) { h.Set("Idempotency-Key", `"secret\qb"`) },
		// Two spellings of the name go out as two field lines of one field:
		// the server refuses them as a list, so the Transport does too.
		"two spellings": func(h http.Header) {
			h.Set("Idempotency-Key", "secret-1")
			h["idempotency-key"] = []string{"secret-1"}
		},
	} {
		req := post(t, context.Background(), ts.URL, "x")
		set(req.Header)
		_, err := tr.RoundTrip(req)
		require.Error(t, err, name)
		assert.ErrorIs(t, err, keygen.ErrInvalidKey, name)
		var ke *keygen.InvalidKeyError
		assert.ErrorAs(t, err, &ke, name)
		assert.NotContains(t, err.Error(), "secret", "%s: the error names the key by its digest only", name)
	}
	assert.Equal(t, int32(0), hits.Load(), "the server saw nothing")
}

func TestIdempotentOverrideRetriesPostOnReadTimeout(t *testing.T) {
	ts, hits := hangingServer(t)
	tr := newTestTransport(nil, WithAutoKeys(false), WithAttemptTimeout(50*time.Millisecond))
	ctx := Idempotent(context.Background(), true)
	_, err := tr.RoundTrip(post(t, ctx, ts.URL, "x"))
	require.Error(t, err)
	assert.Equal(t, int32(3), hits.Load())
}

func TestNotIdempotentOverrideStopsPutRetries(t *testing.T) {
	ts, hits := hangingServer(t)
	tr := newTestTransport(nil, WithAttemptTimeout(50*time.Millisecond))
	req, err := http.NewRequestWithContext(Idempotent(context.Background(), false), http.MethodPut, ts.URL, strings.NewReader("append"))
	require.NoError(t, err)
	_, err = tr.RoundTrip(req)
	require.Error(t, err)
	assert.Equal(t, int32(1), hits.Load())
	// Without the override the same PUT is retried.
	req, err = http.NewRequest(http.MethodPut, ts.URL, strings.NewReader("set"))
	require.NoError(t, err)
	_, err = tr.RoundTrip(req)
	require.Error(t, err)
	assert.Equal(t, int32(4), hits.Load())
}

func TestNoRetryOverride(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	resp, err := tr.RoundTrip(get(t, ts.URL).WithContext(NoRetry(context.Background())))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 503, resp.StatusCode)
	assert.Len(t, srv.Hits(), 1)
}

func TestAutoKeysOffSendsNoKey(t *testing.T) {
	srv := &script{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil, WithAutoKeys(false))
	resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Empty(t, srv.Hits()[0].key)
}

func TestCustomKeyHeader(t *testing.T) {
	var got atomic.Value
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Store(r.Header.Get("X-Request-Key"))
	}))
	defer ts.Close()
	tr := newTestTransport(nil, WithKeyHeader("X-Request-Key"))
	resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.NoError(t, keygen.Validate(got.Load().(string)))
}

// The deadline header goes out only when the caller's context has a
// deadline (the time left before the overall deadline, recomputed per
// attempt), always with WithDeadlineHeader(true), never with
// WithDeadlineHeader(false). The Transport's MaxElapsed alone is not
// advertised by default.
func TestDeadlineHeader(t *testing.T) {
	const sleep1 = 25 * time.Millisecond // attempt 2 starts after it (full jitter, r = 0.5)
	for _, tc := range []struct {
		name    string
		opts    []Option
		timeout time.Duration // of the caller's context; 0 means none
		want    []string      // the header on attempts 1 and 2; "" means absent
	}{
		{name: "default, no context deadline", want: []string{"", ""}},
		{name: "default, context deadline", timeout: 10 * time.Second,
			want: []string{"10000", "9975"}},
		{name: "default, context deadline beyond MaxElapsed", timeout: time.Minute,
			opts: []Option{WithMaxElapsed(10 * time.Second)}, want: []string{"10000", "9975"}},
		{name: "forced on, no context deadline", opts: []Option{WithDeadlineHeader(true), WithMaxElapsed(10 * time.Second)},
			want: []string{"10000", "9975"}},
		{name: "forced on, context deadline", opts: []Option{WithDeadlineHeader(true)}, timeout: 5 * time.Second,
			want: []string{"5000", "4975"}},
		{name: "forced off, context deadline", opts: []Option{WithDeadlineHeader(false)}, timeout: 10 * time.Second,
			want: []string{"", ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := &script{statuses: []int{503, 200}}
				base, url := pipeServer(t, srv)
				tr := newBubbleTransport(base, tc.opts...)
				ctx := context.Background()
				if tc.timeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, tc.timeout)
					defer cancel()
				}
				req := get(t, url).WithContext(ctx)
				resp, err := tr.RoundTrip(req)
				require.NoError(t, err)
				resp.Body.Close()
				hits := srv.Hits()
				require.Len(t, hits, 2)
				assert.Equal(t, []time.Duration{sleep1}, srv.Waits())
				for i, h := range hits {
					assert.Equal(t, tc.want[i], h.header.Get(deadline.Header), "attempt %d", i+1)
					if tc.want[i] == "" {
						assert.NotContains(t, h.header, deadline.Header, "attempt %d", i+1)
					}
				}
				assert.NotContains(t, req.Header, deadline.Header, "the caller's request is never modified")
			})
		})
	}
}

func TestBudgetDenialReturnsTheLastResponse(t *testing.T) {
	srv := &script{statuses: []int{503}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 14})
	h := &recordingHandler{}
	tr := newTestTransport(nil, WithBudget(bucket), WithLogger(slog.New(h)))
	resp, err := tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 503, resp.StatusCode)
	assert.Len(t, srv.Hits(), 2, "one retry bought with the only 14 tokens, then denied")
	last := h.records[len(h.records)-1]
	assert.Equal(t, slog.LevelWarn, last.Level)
	assert.Equal(t, int64(0), attrs(last)["budget_left"].Int64())
	assert.Equal(t, "stopped", attrs(last)["outcome"].String())
	assert.Equal(t, "budget_denied", attrs(last)["stop"].String())
}

func TestCancellationDuringSleepStops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503, 200}}
		base, url := pipeServer(t, srv)
		tr := newBubbleTransport(base, WithBackoff(jitterConfigForCancel))
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() {
			_, err := tr.RoundTrip(get(t, url).WithContext(ctx))
			done <- err
		}()
		synctest.Wait() // the first attempt is answered: the loop sleeps
		require.Len(t, srv.Hits(), 1)
		cancel()
		err := <-done
		require.Error(t, err)
		assert.ErrorIs(t, err, context.Canceled)
		assert.ErrorIs(t, err, retry.ErrExhausted)
		assert.Len(t, srv.Hits(), 1)
	})
}

func TestInProgressConflictIsRetriedAndKeyReusedIsNot(t *testing.T) {
	problem := func(code string) func(http.ResponseWriter) {
		return func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/problem+json")
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(409)
			io.WriteString(w, `{"type":"x","title":"t","status":409,"code":"`+code+`"}`)
		}
	}
	for _, tc := range []struct {
		code string
		hits int
	}{{"idempotency_request_in_progress", 2}, {"idempotency_key_reused", 1}} {
		synctest.Test(t, func(t *testing.T) {
			var n atomic.Int32
			base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n.Add(1) == 1 {
					problem(tc.code)(w)
					return
				}
				w.WriteHeader(201)
			}))
			tr := newBubbleTransport(base)
			start := time.Now()
			resp, err := tr.RoundTrip(post(t, context.Background(), url, "x"))
			require.NoError(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			assert.Equal(t, int32(tc.hits), n.Load(), tc.code)
			if tc.hits == 1 {
				assert.Equal(t, 409, resp.StatusCode)
				assert.Contains(t, string(body), tc.code, "the peeked body is returned whole")
			} else {
				assert.Equal(t, time.Second, time.Since(start), "Retry-After of the in-progress conflict honoured")
			}
		})
	}
}

func TestNilBaseMeansDefaultTransport(t *testing.T) {
	tr := NewTransport(nil)
	assert.Same(t, http.DefaultTransport, tr.base)
	c := NewClient(WithMaxAttempts(2))
	require.IsType(t, &Transport{}, c.Transport)
	assert.Equal(t, 2, c.Transport.(*Transport).cfg.maxAttempts)
}

// An option value below its range means what its documentation says, never
// the default in disguise, and bad input never panics mid-request.
func TestOptionValuesBelowTheirRange(t *testing.T) {
	for _, n := range []int{0, -1} {
		srv := &script{statuses: []int{503, 200}}
		ts := httptest.NewServer(srv)
		tr := newTestTransport(nil, WithMaxAttempts(n))
		resp, err := tr.RoundTrip(get(t, ts.URL))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 503, resp.StatusCode)
		assert.Len(t, srv.Hits(), 1, "WithMaxAttempts(%d) is a single attempt", n)
		ts.Close()
	}

	t.Run("a nil logger logs nothing", func(t *testing.T) {
		h := &recordingHandler{}
		defer slog.SetDefault(slog.Default())
		slog.SetDefault(slog.New(h))
		srv := &script{statuses: []int{503, 200}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		for _, logs := range []bool{false, true} {
			opts := []Option{WithBudget(budget.Unlimited()), fastWaits}
			if !logs {
				opts = append(opts, WithLogger(nil))
			}
			srv.hits = nil
			resp, err := NewTransport(nil, opts...).RoundTrip(get(t, ts.URL))
			require.NoError(t, err)
			resp.Body.Close()
		}
		require.Len(t, h.records, 2, "only the Transport without WithLogger(nil) wrote, to slog.Default()")
	})

	t.Run("a typed nil base is the default transport", func(t *testing.T) {
		ts := httptest.NewServer(&script{statuses: []int{200}})
		defer ts.Close()
		for _, base := range []http.RoundTripper{(*http.Transport)(nil), roundTripperFunc(nil)} {
			resp, err := newTestTransport(base).RoundTrip(get(t, ts.URL))
			require.NoError(t, err, "%T", base)
			resp.Body.Close()
			assert.Equal(t, 200, resp.StatusCode)
		}
	})

	t.Run("a nil option is skipped", func(t *testing.T) {
		tr := NewTransport(nil, nil, WithMaxAttempts(1), nil)
		assert.Equal(t, 1, tr.cfg.maxAttempts, "the options around it apply")
		assert.Equal(t, defaultConfig().maxElapsed, tr.cfg.maxElapsed, "the rest is the default")
	})

	t.Run("a typed nil budget is the default budget", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := &script{statuses: []int{503, 200}}
			base, url := pipeServer(t, srv)
			for _, b := range []budget.Budget{(*budget.TokenBucket)(nil), (*budget.Registry)(nil),
				(*budget.Ratio)(nil),
				budget.NewRegistry(func() budget.Budget { return (*budget.TokenBucket)(nil) }),
				forHosts(func(string) budget.Budget { return nil }),
			} {
				srv.hits = nil
				resp, err := newBubbleTransport(base, WithBudget(b)).RoundTrip(get(t, url))
				require.NoError(t, err, "%T", b)
				resp.Body.Close()
				assert.Equal(t, 200, resp.StatusCode, "%T: retried", b)
				assert.Len(t, srv.Hits(), 2)
			}
		})
	})

	t.Run("no bound of its own: the context's deadline alone", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			tr := newBubbleTransport(blockingBase{}, WithMaxElapsed(0))
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			start := time.Now()
			_, err := tr.RoundTrip(get(t, "http://example.invalid/").WithContext(ctx))
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Equal(t, time.Minute, time.Since(start), "past the default 30 s")
		})
	})
}

// forHosts is a Budget with a For method, as a user's wrapper around a
// budget.Registry is: the Transport asks For for each request's host. Its
// own Budget methods (embedded nil) must never be called.
type forHosts func(host string) budget.Budget

func (f forHosts) For(host string) budget.Budget          { return f(host) }
func (forHosts) OnRequest(time.Time)                      { panic("the host's budget is asked") }
func (forHosts) AcquireRetry(time.Time, bool) (int, bool) { panic("the host's budget is asked") }
func (forHosts) Refund(time.Time, int)                    { panic("the host's budget is asked") }
func (forHosts) OnSuccess(time.Time, int)                 { panic("the host's budget is asked") }
func (forHosts) Available(time.Time) int                  { panic("the host's budget is asked") }

// A Budget with a For method, a user's wrapper around a Registry included,
// gives each host its own budget: draining one host's leaves another's.
func TestABudgetWithForIsAskedPerHost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503}}
		base, _ := pipeServer(t, srv) // every host reaches it
		reg := budget.NewRegistry(func() budget.Budget {
			// One transient retry per host.
			return budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 14})
		})
		wrapper := forHosts(func(host string) budget.Budget { return reg.For(host) })
		tr := newBubbleTransport(base, WithBudget(wrapper))
		for _, host := range []string{"a.test", "b.test"} {
			resp, err := tr.RoundTrip(get(t, "http://"+host+"/"))
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, 503, resp.StatusCode)
		}
		assert.Len(t, srv.Hits(), 4, "each host: one attempt, one retry, then its budget is empty")
	})
}

var errBoom = errors.New("boom")

type failingBody struct{}

func (failingBody) Read([]byte) (int, error) { return 0, errBoom }
func (failingBody) Close() error             { return nil }

func TestUnreadableBodyIsATypedErrorNotAPanic(t *testing.T) {
	tr := newTestTransport(nil)
	req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/", failingBody{})
	require.NoError(t, err)
	_, err = tr.RoundTrip(req)
	assert.ErrorIs(t, err, errBoom)
}

var jitterConfigForCancel = jitter.Config{Base: time.Second}

func TestNoSleepThatWouldEndAfterTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{429, 200}, header: func(_ int, h http.Header) { h.Set("Retry-After", "2") }}
		base, url := pipeServer(t, srv)
		tr := newBubbleTransport(base, WithMaxElapsed(time.Second))
		start := time.Now()
		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err, "the 429 is returned as a response")
		resp.Body.Close()
		assert.Equal(t, 429, resp.StatusCode)
		assert.Len(t, srv.Hits(), 1)
		assert.Zero(t, time.Since(start), "a 2 s wait cannot fit in a 1 s deadline: no sleep in vain")
	})
}

// slowBodyServer sends its headers at once and its body 50 ms later.
func slowBodyServer(t *testing.T) *httptest.Server {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		time.Sleep(50 * time.Millisecond)
		io.WriteString(w, "the whole body")
	}))
	t.Cleanup(ts.Close)
	return ts
}

func TestAttemptTimeoutDoesNotCutTheDeliveredBody(t *testing.T) {
	ts := slowBodyServer(t)
	tr := newTestTransport(nil, WithAttemptTimeout(20*time.Millisecond))
	resp, err := tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	assert.Equal(t, "the whole body", string(body))
}

func TestDeliveredBodyOutlivesTheLoop(t *testing.T) {
	ts := slowBodyServer(t)
	tr := newTestTransport(nil) // the 30 s overall deadline's context stays alive for the body
	resp, err := tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, "the whole body", string(body))
}

// An attempt's time limit that fires as the loop ends that attempt never
// reaches the next one, which starts at the same instant: each timer holds
// its own attempt's cancellation.
func TestAttemptTimerNeverCancelsTheNextAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls atomic.Int32
		base := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
			status := http.StatusOK
			if calls.Add(1)%2 == 1 {
				time.Sleep(time.Second) // a 503 just as the limit fires
				status = http.StatusServiceUnavailable
			}
			return &http.Response{StatusCode: status, Body: io.NopCloser(strings.NewReader("body")),
				Header: http.Header{}, Request: r}, nil
		})
		noWait := func(int, time.Duration, time.Duration, time.Duration, float64) time.Duration { return 0 }
		tr := newBubbleTransport(base, WithAttemptTimeout(time.Second), WithBackoff(jitter.Config{Func: noWait}))
		for range 50 {
			resp, err := tr.RoundTrip(get(t, "http://example.test/"))
			require.NoError(t, err)
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			assert.NoError(t, resp.Request.Context().Err(), "the delivered attempt's context lives on")
			synctest.Wait() // every timer due now has run
			assert.NoError(t, resp.Request.Context().Err(), "no earlier attempt's timer ended it")
			require.NoError(t, resp.Body.Close())
		}
		assert.Equal(t, int32(100), calls.Load())
	})
}

func TestHugeBodyBufferLimitStillSendsTheBody(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil, WithMaxBufferedBody(math.MaxInt64))
	req, err := http.NewRequest(http.MethodPost, ts.URL, io.NopCloser(strings.NewReader("pay 10")))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	for _, h := range srv.Hits() {
		assert.Equal(t, "pay 10", string(h.body))
	}
	assert.Len(t, srv.Hits(), 2)
}

func TestExhaustedErrorCarriesTheKeyForALaterResend(t *testing.T) {
	tr := newTestTransport(nil)
	_, err := tr.RoundTrip(post(t, context.Background(), closedPort(t), "x"))
	var ex *retry.ExhaustedError
	require.ErrorAs(t, err, &ex)
	_, perr := uuid.Parse(ex.Key)
	assert.NoError(t, perr, "the automatic key is handed back")
	assert.NotContains(t, err.Error(), ex.Key, "but never printed")
}

func TestNotIdempotentWinsOverAKeyOnPut(t *testing.T) {
	ts, hits := hangingServer(t)
	tr := newTestTransport(nil, WithAttemptTimeout(50*time.Millisecond))
	req, err := http.NewRequestWithContext(Idempotent(context.Background(), false), http.MethodPut, ts.URL, strings.NewReader("append"))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "put-1")
	_, err = tr.RoundTrip(req)
	require.Error(t, err)
	assert.Equal(t, int32(1), hits.Load(), "servers guard POST and PATCH: a key on a PUT proves nothing")
}

func TestOverridesCombine(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	ctx := Idempotent(NoRetry(context.Background()), true)
	resp, err := tr.RoundTrip(post(t, ctx, ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Len(t, srv.Hits(), 1, "NoRetry survives a later Idempotent")
}

func TestNonCanonicalKeyHeaderIsTheCallersKey(t *testing.T) {
	srv := &script{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil)
	req := post(t, context.Background(), ts.URL, "x")
	req.Header["idempotency-key"] = []string{"mine-1"}
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	h := srv.Hits()[0]
	assert.Equal(t, []string{"mine-1"}, h.header.Values("Idempotency-Key"), "no second, automatic key")
}

func TestFailingGetBodyKeepsTheResponseInHand(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503, 200}}
		base, url := pipeServer(t, srv)
		tr := newBubbleTransport(base)
		req := post(t, context.Background(), url, "x")
		req.GetBody = func() (io.ReadCloser, error) { return nil, errBoom }
		start := time.Now()
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err, "the 503 is returned, not an error")
		resp.Body.Close()
		assert.Equal(t, 503, resp.StatusCode)
		assert.Len(t, srv.Hits(), 1)
		assert.Zero(t, time.Since(start), "no sleep")
	})
}

// The body is rewound only for a retry that is granted: never after the
// last attempt, and a rewind that fails costs the budget nothing.
func TestBodyIsRewoundOnlyForAGrantedRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &script{statuses: []int{503}}
		base, url := pipeServer(t, srv)
		var rewinds atomic.Int32
		req, err := http.NewRequest(http.MethodPut, url, strings.NewReader("x"))
		require.NoError(t, err)
		req.GetBody = func() (io.ReadCloser, error) {
			rewinds.Add(1)
			return io.NopCloser(strings.NewReader("x")), nil
		}
		resp, err := newBubbleTransport(base).RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Len(t, srv.Hits(), 3)
		assert.Equal(t, int32(2), rewinds.Load(), "two retries, two rewinds")

		bucket := budget.NewTokenBucket(budget.TokenBucketConfig{})
		req = post(t, context.Background(), url, "x")
		req.GetBody = func() (io.ReadCloser, error) { return nil, errBoom }
		resp, err = newBubbleTransport(base, WithBudget(bucket)).RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 500, bucket.Available(time.Now()), "a failed rewind spends nothing")
	})
}

// slowBody takes took (on the bubble's clock) per Read: a body that is slow
// to buffer.
type slowBody struct {
	r    io.Reader
	took time.Duration
}

func (b *slowBody) Read(p []byte) (int, error) {
	time.Sleep(b.took)
	return b.r.Read(p)
}
func (b *slowBody) Close() error { return nil }

// The loop's clock, and with it attempt 1's time limit, starts once the
// body is buffered: the time spent reading it is not taken from the
// attempts.
func TestLoopClockStartsAfterTheBodyIsBuffered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
		h := &recordingHandler{}
		tr := newBubbleTransport(base, WithLogger(slog.New(h)), WithMaxElapsed(time.Second))
		req, err := http.NewRequest(http.MethodPut, url, nil)
		require.NoError(t, err)
		req.Body = &slowBody{r: strings.NewReader("payload"), took: 5 * time.Second}
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err, "10 s of reading the body did not use up the 1 s overall deadline")
		resp.Body.Close()
		require.Len(t, h.records, 1)
		assert.Zero(t, attrs(h.records[0])["total"].Duration(),
			"the body's reading (5 s per Read) happened before the loop's clock started")
	})
}

// blockingBase answers at once when fast is set, else waits for the
// attempt's context to end.
type blockingBase struct{ fast bool }

func (b blockingBase) RoundTrip(r *http.Request) (*http.Response, error) {
	if b.fast {
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r}, nil
	}
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// A Transport used outside a testing/synctest bubble and then inside one
// (a user's test with a package-level client) times its attempts in the
// bubble on the bubble's clock: it holds no timer across requests.
func TestAttemptTimeoutInsideASyncTestBubble(t *testing.T) {
	base := &blockingBase{fast: true}
	tr := NewTransport(base, WithBudget(budget.Unlimited()), WithLogger(slog.New(slog.DiscardHandler)),
		WithAttemptTimeout(time.Second), WithMaxAttempts(1))
	for range 3 {
		resp, err := tr.RoundTrip(get(t, "http://example.invalid/"))
		require.NoError(t, err)
		resp.Body.Close()
	}
	base.fast = false
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		_, err := tr.RoundTrip(get(t, "http://example.invalid/"))
		require.ErrorIs(t, err, ErrAttemptTimeout)
		assert.Equal(t, time.Second, time.Since(start), "cut at the attempt timeout, on the bubble's clock")
	})
}

// The attempt's time limit bounds the wait for the response headers only:
// once the response is handed over, its body is read for as long as it
// takes, and the attempt's context ends when the caller closes the body.
func TestDeliveredBodyOutlivesTheAttemptLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(200)
			w.(http.Flusher).Flush()
			time.Sleep(5 * time.Second)
			io.WriteString(w, "the whole body")
		}))
		tr := newBubbleTransport(base, WithAttemptTimeout(time.Second), WithMaxElapsed(2*time.Second))
		start := time.Now()
		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		assert.Equal(t, "the whole body", string(body))
		assert.Equal(t, 5*time.Second, time.Since(start), "read past both the attempt timeout and the overall deadline")
		attemptCtx := resp.Request.Context()
		assert.NoError(t, attemptCtx.Err(), "the attempt's context lives until the body is closed")
		require.NoError(t, resp.Body.Close())
		assert.ErrorIs(t, attemptCtx.Err(), context.Canceled, "closing the body releases the attempt's context")
	})
}

// The caller's cancellation ends the attempt in flight and the loop: the
// error is the caller's, not an attempt timeout, and nothing is retried.
func TestCallerCancellationEndsTheAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tr := newBubbleTransport(blockingBase{}, WithAttemptTimeout(10*time.Second))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		time.AfterFunc(time.Second, cancel)
		start := time.Now()
		_, err := tr.RoundTrip(get(t, "http://example.invalid/").WithContext(ctx))
		assert.Equal(t, time.Second, time.Since(start))
		assert.ErrorIs(t, err, context.Canceled)
		assert.NotErrorIs(t, err, ErrAttemptTimeout)
		var ex *retry.ExhaustedError
		require.ErrorAs(t, err, &ex)
		assert.Equal(t, 1, ex.Attempts)
		assert.Equal(t, retry.ReasonCanceled, ex.Reason)
	})
}

// The overall deadline bounds the whole loop: an attempt is cut when it is
// reached (an attempt timeout, not the caller's deadline), and no sleep
// starts that would end after it.
func TestOverallDeadlineBoundsTheLoop(t *testing.T) {
	t.Run("one attempt cut by the deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var attemptCtx context.Context
			base := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
				attemptCtx = r.Context()
				return blockingBase{}.RoundTrip(r)
			})
			tr := newBubbleTransport(base, WithMaxElapsed(time.Second))
			start := time.Now()
			_, err := tr.RoundTrip(get(t, "http://example.invalid/"))
			assert.Equal(t, time.Second, time.Since(start))
			assert.ErrorIs(t, err, ErrAttemptTimeout)
			assert.NotErrorIs(t, err, context.DeadlineExceeded)
			assert.Equal(t, ErrAttemptTimeout, context.Cause(attemptCtx), "the limit's cancellation says why")
			var ex *retry.ExhaustedError
			require.ErrorAs(t, err, &ex)
			assert.Equal(t, 1, ex.Attempts)
			assert.Equal(t, retry.ReasonDeadline, ex.Reason)
		})
	})
	t.Run("attempt timeouts and sleeps", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			// Attempts of 300 ms, sleeps of 25 then 50 ms: attempt 3 ends
			// at 975 ms, and a sleep of 100 ms would cross the 1 s deadline.
			tr := newBubbleTransport(blockingBase{}, WithMaxElapsed(time.Second),
				WithAttemptTimeout(300*time.Millisecond), WithMaxAttempts(10))
			start := time.Now()
			_, err := tr.RoundTrip(get(t, "http://example.invalid/"))
			assert.Equal(t, 975*time.Millisecond, time.Since(start))
			assert.ErrorIs(t, err, ErrAttemptTimeout)
			var ex *retry.ExhaustedError
			require.ErrorAs(t, err, &ex)
			assert.Equal(t, 3, ex.Attempts)
			assert.Equal(t, retry.ReasonDeadline, ex.Reason)
		})
	})
}

// When the caller's deadline ends the attempt, the error is the caller's
// (context.DeadlineExceeded), never an attempt timeout, even when the
// per-attempt timeout would end at the same instant.
func TestCallerDeadlineIsNotAnAttemptTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tr := newBubbleTransport(blockingBase{}, WithAttemptTimeout(time.Second))
		// Timers due at the same instant fire in no set order: a Transport
		// that raced its own limit against the caller's deadline would
		// lose some of these rounds.
		for range 20 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_, err := tr.RoundTrip(get(t, "http://example.invalid/").WithContext(ctx))
			cancel()
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.NotErrorIs(t, err, ErrAttemptTimeout)
			var ex *retry.ExhaustedError
			require.ErrorAs(t, err, &ex)
			assert.Equal(t, 1, ex.Attempts)
			assert.Equal(t, retry.ReasonCanceled, ex.Reason)
		}
	})
}

// roundTripperFunc is a base RoundTripper made of a function.
type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// The attempt's time limit stops when the response is handed over, before
// the AttemptDone observers of a final answer run: an observer slower than
// the time left cannot cut the body of the response the caller gets.
func TestSlowObserverDoesNotCutTheDeliveredBody(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base, url := pipeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(200)
			w.(http.Flusher).Flush()
			time.Sleep(10 * time.Millisecond)
			io.WriteString(w, "hello")
		}))
		tr := newBubbleTransport(base, WithAttemptTimeout(100*time.Millisecond), WithObserver(Observer{
			AttemptDone: func(context.Context, AttemptDoneInfo) { time.Sleep(150 * time.Millisecond) },
		}))
		resp, err := tr.RoundTrip(get(t, url))
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, "hello", string(body))
	})
}

// lateThenFast ignores the context: its first answer comes after d, its
// later ones at once.
type lateThenFast struct {
	d     time.Duration
	calls atomic.Int32
}

func (b *lateThenFast) RoundTrip(r *http.Request) (*http.Response, error) {
	body := "fresh"
	if b.calls.Add(1) == 1 {
		time.Sleep(b.d)
		body = "late"
	}
	return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader(body)), Header: http.Header{}, Request: r}, nil
}

// A response whose headers arrive after the attempt's limit fired is not
// handed over (its attempt's context is canceled, its body dead): the attempt
// timed out, and an idempotent request is retried.
func TestResponseAfterTheLimitFiredIsATimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		base := &lateThenFast{d: 2 * time.Second}
		tr := newBubbleTransport(base, WithAttemptTimeout(time.Second))
		resp, err := tr.RoundTrip(get(t, "http://example.test/"))
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, "fresh", string(body))
		assert.Equal(t, int32(2), base.calls.Load())
	})
}
