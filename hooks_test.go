package saferetry

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// retryEverything is the widest policy a user can write.
var retryEverything = WithRetryPolicy(func(retry.Input, retry.Decision) retry.Verdict { return retry.Allow })

func TestPolicyCannotRetryUnkeyedPostAfterItMayHaveLeft(t *testing.T) {
	t.Run("503", func(t *testing.T) {
		srv := &script{statuses: []int{503, 200}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		tr := newTestTransport(nil, WithAutoKeys(false), retryEverything)
		resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "pay 10"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 503, resp.StatusCode)
		assert.Len(t, srv.Hits(), 1, "a 503 proves the POST arrived: never sent again without a key")
	})
	t.Run("read timeout", func(t *testing.T) {
		ts, hits := hangingServer(t)
		tr := newTestTransport(nil, WithAutoKeys(false), retryEverything, WithAttemptTimeout(30*time.Millisecond))
		_, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "pay 10"))
		require.ErrorIs(t, err, ErrAttemptTimeout)
		var ex *retry.ExhaustedError
		require.ErrorAs(t, err, &ex)
		assert.Equal(t, retry.ReasonNotRetryable, ex.Reason)
		assert.Equal(t, int32(1), hits.Load())
	})
	t.Run("marked NotIdempotent", func(t *testing.T) {
		srv := &script{statuses: []int{500, 200}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		tr := newTestTransport(nil, retryEverything)
		req, err := http.NewRequestWithContext(Idempotent(context.Background(), false), http.MethodPut, ts.URL, nil)
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Len(t, srv.Hits(), 1)
	})
	t.Run("the same policy retries a keyed POST", func(t *testing.T) {
		// The control: the policy is in force, only safety stopped it above.
		srv := &script{statuses: []int{500, 200}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		tr := newTestTransport(nil, retryEverything)
		resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "pay 10"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, 200, resp.StatusCode)
		assert.Len(t, srv.Hits(), 2)
	})
}

func TestPolicyStillHonoursAttemptsBudgetAndCancellation(t *testing.T) {
	t.Run("attempts", func(t *testing.T) {
		srv := &script{statuses: []int{500}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		tr := newTestTransport(nil, retryEverything)
		resp, err := tr.RoundTrip(get(t, ts.URL))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Len(t, srv.Hits(), 3, "the default attempts")
	})
	t.Run("budget", func(t *testing.T) {
		srv := &script{statuses: []int{500}}
		ts := httptest.NewServer(srv)
		defer ts.Close()
		bucket := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 14})
		tr := newTestTransport(nil, retryEverything, WithBudget(bucket), WithMaxAttempts(10))
		resp, err := tr.RoundTrip(get(t, ts.URL))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Len(t, srv.Hits(), 2, "one retry bought with the only 14 tokens, then denied")
	})
	t.Run("cancellation", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			cancel()
			return nil, r.Context().Err()
		})
		n := 0
		counting := roundTripFunc(func(r *http.Request) (*http.Response, error) { n++; return base(r) })
		tr := newTestTransport(counting, retryEverything)
		_, err := tr.RoundTrip(get(t, "http://x.invalid/").WithContext(ctx))
		require.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 1, n)
	})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

var errShardMoving = errors.New("shard moving")

// onRequest applies r to the requests match accepts, as a user's rule that
// looks at the request does.
func onRequest(match func(*http.Request) bool, r retry.Rule) retry.Rule {
	return func(in retry.Input, d retry.Decision) retry.Verdict {
		if in.Request == nil || !match(in.Request) {
			return retry.Keep
		}
		return r(in, d)
	}
}

func TestPolicyWidensAndNarrowsPerRequest(t *testing.T) {
	srv := &script{statuses: []int{500, 503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	host := strings.TrimPrefix(ts.URL, "http://")
	onHost := func(r *http.Request) bool { return r.URL.Host == host }
	onPath := func(r *http.Request) bool { return r.URL.Path == "/fragile" }
	tr := newTestTransport(nil, WithMaxAttempts(5),
		WithRetryPolicy(onRequest(onHost, retry.Status(retry.Allow, 500))),
		WithRetryPolicy(onRequest(onPath, retry.Status(retry.Deny, 503))))

	resp, err := tr.RoundTrip(get(t, ts.URL+"/fragile"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 503, resp.StatusCode, "500 retried on this host, 503 not on this path")
	assert.Len(t, srv.Hits(), 2)

	// A custom error: retried for a GET.
	calls := 0
	flaky := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		calls++
		if calls == 1 {
			return nil, errShardMoving
		}
		return http.DefaultTransport.RoundTrip(r)
	})
	custom := func(in retry.Input, _ retry.Decision) retry.Verdict {
		if errors.Is(in.Err, errShardMoving) && in.Attempt == 1 {
			return retry.Allow
		}
		return retry.Keep
	}
	tr = newTestTransport(flaky, WithRetryPolicy(custom))
	resp, err = tr.RoundTrip(get(t, ts.URL))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 200, resp.StatusCode)
	assert.Equal(t, 2, calls)
}

func TestPrepareSignsEachAttemptOnItsOwnCopy(t *testing.T) {
	srv := &script{statuses: []int{503, 503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	var bodies []string
	sign := func(r *http.Request, attempt int) error {
		require.NotNil(t, r.GetBody, "a replayable body can be hashed")
		b, err := r.GetBody()
		require.NoError(t, err)
		p, _ := io.ReadAll(b)
		bodies = append(bodies, string(p))
		r.Header.Set("X-Signature", "sig-"+strconv.Itoa(attempt)+"-"+string(p))
		r.Header.Add("X-Trace", "added")
		q := r.URL.Query()
		q.Set("attempt", strconv.Itoa(attempt))
		r.URL.RawQuery = q.Encode()
		return nil
	}
	tr := newTestTransport(nil, WithPrepare(sign), WithDeadlineHeader(true))

	body := &spyBody{Reader: strings.NewReader("hello")}
	req, err := http.NewRequest(http.MethodPost, ts.URL+"/pay?x=1", body)
	require.NoError(t, err)
	req.Header["X-Trace"] = make([]string, 1, 4) // room to append into: must not be written
	req.Header["X-Trace"][0] = "t1"
	before := req.Header.Clone()
	urlBefore := *req.URL

	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()

	hits := srv.Hits()
	require.Len(t, hits, 3)
	for i, h := range hits {
		assert.Equal(t, "sig-"+strconv.Itoa(i+1)+"-hello", h.header.Get("X-Signature"))
		assert.Equal(t, []string{"t1", "added"}, h.header.Values("X-Trace"))
		assert.NotEmpty(t, h.key)
		assert.Equal(t, hits[0].key, h.key, "the key is the same on every attempt")
		assert.NotEmpty(t, h.header.Get("Request-Deadline-Ms"), "set before preparation")
		assert.Equal(t, "hello", string(h.body))
	}
	assert.Equal(t, []string{"hello", "hello", "hello"}, bodies)
	assert.Equal(t, before, req.Header, "the caller's headers never change")
	assert.Equal(t, "", req.Header["X-Trace"][:2][1], "nothing appended into the caller's backing array")
	assert.Equal(t, urlBefore, *req.URL, "nor its URL")
	assert.True(t, body.closed.Load())
}

var errTokenExpired = errors.New("token expired")

func TestPrepareErrorEndsTheLoopTyped(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	failSecond := func(r *http.Request, attempt int) error {
		if attempt == 2 {
			return errTokenExpired
		}
		return nil
	}
	tr := newTestTransport(nil, WithPrepare(failSecond))
	req := post(t, context.Background(), ts.URL, "pay 10")
	_, err := tr.RoundTrip(req)
	require.Error(t, err)
	assert.ErrorIs(t, err, errTokenExpired)
	assert.ErrorIs(t, err, retry.ErrExhausted)
	assert.Contains(t, err.Error(), "preparing attempt 2: token expired")
	var ex *retry.ExhaustedError
	require.ErrorAs(t, err, &ex)
	assert.Equal(t, retry.ReasonPrepare, ex.Reason)
	assert.Equal(t, 1, ex.Attempts, "one attempt was sent")
	hits := srv.Hits()
	require.Len(t, hits, 1)
	assert.Equal(t, hits[0].key, ex.Key, "the key to re-send with")

	// Failing on the first attempt: nothing is sent and the caller's body
	// is closed.
	body := &spyBody{Reader: strings.NewReader("x")}
	req, err = http.NewRequest(http.MethodPost, ts.URL, body)
	require.NoError(t, err)
	tr = newTestTransport(nil, WithPrepare(func(*http.Request, int) error { return errTokenExpired }))
	_, err = tr.RoundTrip(req)
	require.ErrorAs(t, err, &ex)
	assert.Equal(t, 0, ex.Attempts)
	assert.Len(t, srv.Hits(), 1)
	assert.True(t, body.closed.Load())
}

func TestPrepareCannotChangeTheKey(t *testing.T) {
	cases := map[string]struct {
		method string
		key    string // the caller's, "" for an automatic one or none
		f      func(r *http.Request)
	}{
		"changed":                   {http.MethodPost, "", func(r *http.Request) { r.Header.Set("Idempotency-Key", "other") }},
		"removed":                   {http.MethodPost, "", func(r *http.Request) { r.Header.Del("Idempotency-Key") }},
		"caller's changed":          {http.MethodPost, "k1", func(r *http.Request) { r.Header.Set("Idempotency-Key", "k2") }},
		"added in another spelling": {http.MethodPost, "k1", func(r *http.Request) { r.Header["idempotency-key"] = []string{"k2"} }},
		"added to a GET":            {http.MethodGet, "", func(r *http.Request) { r.Header.Set("Idempotency-Key", "k") }},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			srv := &script{statuses: []int{200}}
			ts := httptest.NewServer(srv)
			defer ts.Close()
			tr := newTestTransport(nil, WithPrepare(func(r *http.Request, _ int) error { c.f(r); return nil }))
			req, err := http.NewRequest(c.method, ts.URL, strings.NewReader("x"))
			require.NoError(t, err)
			if c.key != "" {
				req.Header.Set("Idempotency-Key", c.key)
			}
			_, err = tr.RoundTrip(req)
			require.ErrorIs(t, err, ErrKeyChanged)
			assert.Empty(t, srv.Hits(), "refused before sending")
			if c.key != "" {
				assert.Equal(t, c.key, req.Header.Get("Idempotency-Key"))
			}
		})
	}
	// Setting it to the same value is no change.
	srv := &script{statuses: []int{200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := newTestTransport(nil, WithPrepare(func(r *http.Request, _ int) error {
		r.Header.Set("Idempotency-Key", r.Header.Get("Idempotency-Key"))
		return nil
	}))
	resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()
}

// event is one observer call, flattened for comparison.
type event struct {
	kind    string
	attempt int
	class   retry.Class
	outcome Outcome
	stop    retry.Reason
	status  int
	tag     any // the value the attempt's context carried
}

type tagKey struct{}

type eventLog struct {
	mu     sync.Mutex
	events []event
	calls  []CallDoneInfo
	dones  []AttemptDoneInfo
}

func (l *eventLog) observer(name string) Observer {
	return Observer{
		AttemptStart: func(ctx context.Context, a AttemptStartInfo) context.Context {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.events = append(l.events, event{kind: name + ":start", attempt: a.Attempt, class: a.Retrying, tag: ctx.Value(tagKey{})})
			return context.WithValue(ctx, tagKey{}, name+strconv.Itoa(a.Attempt))
		},
		AttemptDone: func(ctx context.Context, a AttemptDoneInfo) {
			l.mu.Lock()
			defer l.mu.Unlock()
			e := event{kind: name + ":done", attempt: a.Attempt, class: a.Decision.Class, outcome: a.Outcome,
				stop: a.Stop, tag: ctx.Value(tagKey{})}
			if a.Response != nil {
				e.status = a.Response.StatusCode
			}
			l.events = append(l.events, e)
			l.dones = append(l.dones, a)
		},
		CallDone: func(_ context.Context, c CallDoneInfo) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.events = append(l.events, event{kind: name + ":call", attempt: c.Attempts, outcome: c.Outcome,
				stop: c.Stop})
			l.calls = append(l.calls, c)
		},
	}
}

func TestObserversSeeEveryAttemptAndCall(t *testing.T) {
	srv := &script{statuses: []int{503, 502, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	var seen []any // the context the base transport and the preparation saw
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		seen = append(seen, r.Context().Value(tagKey{}))
		return http.DefaultTransport.RoundTrip(r)
	})
	l := &eventLog{}
	tr := newTestTransport(base, WithObserver(l.observer("a")), WithObserver(l.observer("b")),
		WithObserver(Observer{}), // ignored
		WithPrepare(func(r *http.Request, _ int) error { seen = append(seen, r.Context().Value(tagKey{})); return nil }))
	resp, err := tr.RoundTrip(post(t, context.Background(), ts.URL, "x"))
	require.NoError(t, err)
	resp.Body.Close()

	want := []event{}
	prev := retry.Class("")
	for n, st := range []struct {
		class   retry.Class
		outcome Outcome
		stop    retry.Reason
		status  int
	}{{"status_503", OutcomeRetry, "", 503}, {"status_502", OutcomeRetry, "", 502},
		{retry.ClassOK, OutcomeFinal, retry.ReasonNotRetryable, 200}} {
		a, b := "a"+strconv.Itoa(n+1), "b"+strconv.Itoa(n+1)
		want = append(want,
			event{kind: "a:start", attempt: n + 1, class: prev},         // the class it retries
			event{kind: "b:start", attempt: n + 1, class: prev, tag: a}, // composed: b sees a's context
			event{kind: "a:done", attempt: n + 1, class: st.class, outcome: st.outcome, stop: st.stop,
				status: st.status, tag: b},
			event{kind: "b:done", attempt: n + 1, class: st.class, outcome: st.outcome, stop: st.stop,
				status: st.status, tag: b})
		prev = st.class
	}
	want = append(want,
		event{kind: "a:call", attempt: 3, outcome: OutcomeFinal, stop: retry.ReasonNotRetryable},
		event{kind: "b:call", attempt: 3, outcome: OutcomeFinal, stop: retry.ReasonNotRetryable})
	assert.Equal(t, want, l.events)
	assert.Equal(t, []any{"b1", "b1", "b2", "b2", "b3", "b3"}, seen)

	require.Len(t, l.dones, 6)
	assert.Positive(t, l.dones[0].Wait, "the wait chosen")
	assert.NotEmpty(t, l.dones[0].Key)
	assert.Equal(t, l.dones[0].Key, l.calls[0].Key)
	assert.Same(t, resp, l.calls[0].Response)
	assert.NoError(t, l.calls[0].Err)
	assert.GreaterOrEqual(t, l.calls[0].Total, l.dones[5].Total)
}

func TestObserverSeesBudgetDenialAndExhaustion(t *testing.T) {
	l := &eventLog{}
	bucket := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 14})
	tr := newTestTransport(nil, WithObserver(l.observer("o")), WithBudget(bucket))
	_, err := tr.RoundTrip(get(t, "http://"+closedPort(t)+"/"))
	require.Error(t, err)
	require.Len(t, l.dones, 2)
	assert.Equal(t, OutcomeRetry, l.dones[0].Outcome)
	assert.Empty(t, l.dones[0].Stop)
	assert.Equal(t, OutcomeStopped, l.dones[1].Outcome)
	assert.Equal(t, retry.ReasonBudget, l.dones[1].Stop)
	assert.Equal(t, 0, l.dones[1].BudgetLeft)
	assert.True(t, l.dones[1].Decision.NeverSent)
	require.Len(t, l.calls, 1)
	assert.Equal(t, 2, l.calls[0].Attempts)
	assert.Equal(t, OutcomeStopped, l.calls[0].Outcome)
	assert.Equal(t, retry.ReasonBudget, l.calls[0].Stop)
	assert.Same(t, err, l.calls[0].Err)
	assert.Nil(t, l.calls[0].Response)
}

func TestObserverNotCalledWhenNoAttemptStarts(t *testing.T) {
	l := &eventLog{}
	tr := newTestTransport(nil, WithObserver(l.observer("o")))
	req := get(t, "http://127.0.0.1:1/")
	req.Header.Set("Idempotency-Key", "has\x01control")
	_, err := tr.RoundTrip(req)
	require.ErrorIs(t, err, keygen.ErrInvalidKey)
	assert.Empty(t, l.events)
}

func TestCloseIdleConnectionsReachesTheBase(t *testing.T) {
	closed := make(chan struct{}, 1)
	ts := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateClosed {
			closed <- struct{}{}
		}
	}
	ts.Start()
	defer ts.Close()
	base := &http.Transport{}
	client := &http.Client{Transport: newTestTransport(base)}
	resp, err := client.Get(ts.URL)
	require.NoError(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	client.CloseIdleConnections()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the idle connection was not closed")
	}
	// A base without the method: nothing happens, nothing panics.
	newTestTransport(roundTripFunc(func(*http.Request) (*http.Response, error) { return nil, errBoom })).CloseIdleConnections()
}

// When a retry's preparation fails, the AttemptDone observers see that
// attempt, never sent, with the preparation's error, as AttemptDoneInfo.Err
// documents.
func TestObserversSeeThePreparationsError(t *testing.T) {
	srv := &script{statuses: []int{503, 200}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	var done []AttemptDoneInfo
	tr := newTestTransport(nil, WithPrepare(func(_ *http.Request, attempt int) error {
		if attempt == 2 {
			return errTokenExpired
		}
		return nil
	}), WithObserver(Observer{AttemptDone: func(_ context.Context, a AttemptDoneInfo) {
		done = append(done, a)
	}}))
	_, err := tr.RoundTrip(get(t, ts.URL))
	require.ErrorIs(t, err, errTokenExpired)
	require.Len(t, done, 2)
	assert.Equal(t, OutcomeStopped, done[1].Outcome)
	assert.Equal(t, retry.ReasonPrepare, done[1].Stop)
	assert.ErrorIs(t, done[1].Err, errTokenExpired)
}
