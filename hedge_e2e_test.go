package saferetry

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// payments is a server behind the real idempotency middleware over the
// memory store: each POST /payments makes one effect (counted per key)
// after the handler's delay for that attempt, and every answer the client
// gets is recorded with the middleware's verdict.
type payments struct {
	delay   func(key string, effect int64) time.Duration
	effects sync.Map // key -> *atomic.Int64
	total   atomic.Int64
	mu      sync.Mutex
	answers []paymentAnswer
}

type paymentAnswer struct {
	attempt  string
	status   int
	replayed bool
	code     string
}

func (p *payments) handler() http.Handler {
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		c, _ := p.effects.LoadOrStore(key, &atomic.Int64{})
		n := c.(*atomic.Int64).Add(1)
		p.total.Add(1)
		if d := p.delay(key, n); d > 0 {
			time.Sleep(d) // the handler runs to its end, whatever the client does
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%q,"effect":%d}`, key, n)
	})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(nil))
	wrapped := mw.Wrap(handler)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w}
		wrapped.ServeHTTP(rec, r)
		a := paymentAnswer{attempt: r.Header.Get(attemptHeader), status: rec.status,
			replayed: w.Header().Get(idempotency.ReplayedHeader) == "true"}
		if rec.status == http.StatusConflict {
			a.code = string(idempotency.CodeInProgress)
			if !strings.Contains(rec.body.String(), a.code) {
				a.code = rec.body.String()
			}
		}
		p.mu.Lock()
		p.answers = append(p.answers, a)
		p.mu.Unlock()
	})
}

func (p *payments) Answers() []paymentAnswer {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]paymentAnswer(nil), p.answers...)
}

type statusRecorder struct {
	http.ResponseWriter
	status int
	body   strings.Builder
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	r.body.Write(b)
	return r.ResponseWriter.Write(b)
}

// slowReturn is a base transport whose answers to the attempts numbered in
// slow come back late: the request reached the server at once, its answer
// waits on the way back (or until the attempt is canceled).
type slowReturn struct {
	base http.RoundTripper
	slow map[string]time.Duration
}

func (s slowReturn) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.base.RoundTrip(r)
	d, ok := s.slow[r.Header.Get(attemptHeader)]
	if err != nil || !ok {
		return resp, err
	}
	select {
	case <-time.After(d):
		return resp, nil
	case <-r.Context().Done():
		resp.Body.Close()
		return nil, r.Context().Err()
	}
}

func pay(t *testing.T, tr http.RoundTripper, url, key string) (
	status int, body string, replayed bool) {
	req, err := http.NewRequest(http.MethodPost, url+"/payments", strings.NewReader(`{"amount":100}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer account-1")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b), resp.Header.Get(idempotency.ReplayedHeader) == "true"
}

// A hedged POST through the real idempotency middleware makes one effect:
// the hedge carries the first attempt's key, and the middleware answers it
// with the in-progress 409 while the first attempt's handler runs (the
// Transport sets it aside and waits for the first), or with the replay
// once the first has completed (the replay wins, and the first attempt,
// whose answer is still on its way, loses).
func TestAHedgedPostMakesOneEffectThroughTheMiddleware(t *testing.T) {
	t.Run("the loser gets the in-progress 409", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			p := &payments{delay: func(_ string, n int64) time.Duration { return time.Second }}
			base, url := pipeServer(t, p.handler())
			tr := newBubbleTransport(base, WithHedging(Hedging{Delay: 10 * time.Millisecond}))
			start := time.Now()
			status, body, replayed := pay(t, tr, url, "")
			assert.Equal(t, http.StatusCreated, status)
			assert.False(t, replayed)
			assert.Equal(t, time.Second, time.Since(start), "the first attempt's answer")
			assert.Contains(t, body, `"effect":1`)
			assert.EqualValues(t, 1, p.total.Load(), "one effect")
			assert.ElementsMatch(t, []paymentAnswer{
				{attempt: "2", status: http.StatusConflict, code: string(idempotency.CodeInProgress)},
				{attempt: "1", status: http.StatusCreated},
			}, p.Answers())
		})
	})
	t.Run("the loser's answer is late, the hedge gets the replay", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			p := &payments{delay: func(string, int64) time.Duration { return 0 }}
			base, url := pipeServer(t, p.handler())
			late := slowReturn{base: base, slow: map[string]time.Duration{"1": time.Second}}
			tr := newBubbleTransport(late, WithHedging(Hedging{Delay: 10 * time.Millisecond}))
			start := time.Now()
			status, body, replayed := pay(t, tr, url, "order-42-charge")
			assert.Equal(t, http.StatusCreated, status)
			assert.True(t, replayed, "the replay of the first attempt's answer")
			assert.Equal(t, 10*time.Millisecond, time.Since(start))
			assert.Equal(t, `{"payment":"order-42-charge","effect":1}`, body)
			assert.EqualValues(t, 1, p.total.Load(), "one effect")
			assert.Equal(t, []paymentAnswer{
				{attempt: "1", status: http.StatusCreated},
				{attempt: "2", status: http.StatusCreated, replayed: true},
			}, p.Answers())
		})
	})
}

// Many hedged POSTs at once, some with slow handlers, some with slow
// answers: every logical POST makes exactly one effect and gets a 201.
func TestConcurrentHedgedPostsMakeNoDuplicateEffect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 40
		p := &payments{delay: func(key string, _ int64) time.Duration {
			if strings.HasSuffix(key, "0") || strings.HasSuffix(key, "5") {
				return 200 * time.Millisecond
			}
			return time.Millisecond
		}}
		base, url := pipeServer(t, p.handler())
		late := slowReturn{base: base, slow: map[string]time.Duration{"1": 300 * time.Millisecond}}
		var wg sync.WaitGroup
		for i := range n {
			var rt http.RoundTripper = late
			if i%3 == 0 {
				rt = base // answers on time
			}
			tr := newBubbleTransport(rt, WithHedging(Hedging{Delay: 20 * time.Millisecond, MaxHedges: 2}))
			wg.Go(func() {
				status, _, _ := pay(t, tr, url, fmt.Sprintf("charge-%02d", i))
				assert.Equal(t, http.StatusCreated, status)
			})
		}
		wg.Wait()
		synctest.Wait()
		effects := 0
		p.effects.Range(func(k, v any) bool {
			effects++
			assert.EqualValues(t, 1, v.(*atomic.Int64).Load(), "%v: one effect", k)
			return true
		})
		assert.Equal(t, n, effects)
		hedged := 0
		for _, a := range p.Answers() {
			if a.attempt != "1" {
				hedged++
			}
		}
		assert.Greater(t, hedged, n/2, "most of them were hedged")
	})
}
