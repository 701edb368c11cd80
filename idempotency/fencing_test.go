package idempotency

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeClock is a manually advanced clock for the middleware's now hook.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func withClock(c *fakeClock) Option {
	return func(cfg *config) { cfg.now = c.Now }
}

var discard = slog.New(slog.DiscardHandler)

// send serves one guarded POST through h in process. It sends no
// credentials: the internal tests' records have the principal
// "", so their middleware opts in with WithAnonymousKeys.
func send(t *testing.T, h http.Handler, key, body string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// plain hides the MemoryStore's Begin.
type plain struct{ Store }

// Acceptance 6: handler A stalls past its lease (its heartbeats do not get
// through), B takes the record over and completes; A's late completion is
// rejected, A's business write never commits (with a Transactor), and B's
// record stands. The clock is injected; nothing sleeps.
func TestFencingStalledOwner(t *testing.T) {
	for _, transactor := range []bool{true, false} {
		t.Run(fmt.Sprintf("transactor=%v", transactor), func(t *testing.T) {
			mem := NewMemoryStore()
			var store Store = mem
			if !transactor {
				store = plain{mem}
			}
			clock := &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
			var (
				calls     atomic.Int64
				committed []string // business writes that committed
				mu        sync.Mutex
				aStarted  = make(chan struct{})
				aResume   = make(chan struct{})
			)
			next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				who := "B"
				if calls.Add(1) == 1 {
					who = "A"
					close(aStarted)
					<-aResume // stalled: a GC pause, a frozen VM, a slow downstream
				}
				run, _ := FromContext(r.Context())
				write := func() { mu.Lock(); committed = append(committed, who); mu.Unlock() }
				if u, _, err := run.Unit(r.Context()); err == nil {
					u.(interface{ OnCommit(func()) }).OnCommit(write)
				} else {
					require.ErrorIs(t, err, ErrNoTransactor)
					write() // no transaction: the write happens regardless
				}
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, "charged by "+who)
			})
			h := New(store, WithAnonymousKeys(), withClock(clock), WithLease(30*time.Second), WithLogger(discard))(next)

			aDone := make(chan *httptest.ResponseRecorder)
			go func() { aDone <- send(t, h, "k", `{"amount":1}`) }()
			<-aStarted

			// Before the lease ends, B is told to wait.
			clock.Advance(29 * time.Second)
			b := send(t, h, "k", `{"amount":1}`)
			require.Equal(t, http.StatusConflict, b.Code)
			require.Contains(t, b.Body.String(), CodeInProgress)

			// After it, B takes over (generation 2) and completes.
			clock.Advance(2 * time.Second)
			b = send(t, h, "k", `{"amount":1}`)
			require.Equal(t, http.StatusCreated, b.Code)
			require.Equal(t, "charged by B", b.Body.String())
			rec, err := mem.Get(t.Context(), Scope{Method: "POST", Route: "/payments", Key: "k"})
			require.NoError(t, err)
			require.Equal(t, Completed, rec.State)
			require.EqualValues(t, 2, rec.Generation)

			// A wakes up; its completion is fenced off, and its client gets
			// B's stored response, marked replayed.
			close(aResume)
			a := <-aDone
			require.Equal(t, http.StatusCreated, a.Code)
			require.Equal(t, "charged by B", a.Body.String())
			require.Equal(t, "true", a.Header().Get(ReplayedHeader))

			rec2, err := mem.Get(t.Context(), rec.Scope)
			require.NoError(t, err)
			require.Equal(t, rec.Owner, rec2.Owner)
			require.Equal(t, "charged by B", string(rec2.Response.Body))
			if transactor {
				require.Equal(t, []string{"B"}, committed, "A's write must roll back with its fenced unit")
			} else {
				require.Equal(t, []string{"B", "A"}, committed, "without a transaction A's write stands (documented)")
			}
			// Later retries replay B.
			r := send(t, h, "k", `{"amount":1}`)
			require.Equal(t, "charged by B", r.Body.String())
			require.Equal(t, "true", r.Header().Get(ReplayedHeader))
		})
	}
}

// WithInProgressWait: a duplicate waits (polling the store with the injected
// clock and sleep) and gets the replay once the first completes; with no
// completion it gets 409 when the wait runs out.
func TestInProgressWait(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	var slept atomic.Int64
	var onSleep atomic.Value // func()
	fakeSleep := func(ctx context.Context, d time.Duration) error {
		slept.Add(1)
		clock.Advance(d)
		if f, ok := onSleep.Load().(func()); ok && f != nil {
			f()
		}
		return ctx.Err()
	}
	gate := make(chan struct{})
	started := make(chan struct{}, 1)
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-gate
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "done")
	})
	h := New(mem, WithAnonymousKeys(), withClock(clock), WithInProgressWait(2*time.Second), WithLogger(discard),
		func(c *config) { c.sleep = fakeSleep; c.pollInterval = 500 * time.Millisecond })(next)

	first := make(chan *httptest.ResponseRecorder)
	go func() { first <- send(t, h, "k", `{}`) }()
	<-started
	// The waiter polls; on its second sleep the first request completes.
	var finished sync.Once
	var firstRec *httptest.ResponseRecorder
	onSleep.Store(func() {
		if slept.Load() == 2 {
			finished.Do(func() { close(gate); firstRec = <-first })
		}
	})
	dup := send(t, h, "k", `{}`)
	require.Equal(t, http.StatusCreated, dup.Code)
	require.Equal(t, "done", dup.Body.String())
	require.Equal(t, "true", dup.Header().Get(ReplayedHeader))
	require.Equal(t, "done", firstRec.Body.String())
	require.EqualValues(t, 2, slept.Load())

	// A key that never completes: 4 polls of 500 ms, then 409.
	gate2 := make(chan struct{})
	next2 := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-gate2 })
	onSleep.Store(func() {})
	slept.Store(0)
	h2 := New(mem, WithAnonymousKeys(), withClock(clock), WithInProgressWait(2*time.Second), WithLogger(discard),
		func(c *config) { c.sleep = fakeSleep; c.pollInterval = 500 * time.Millisecond })(next2)
	go2 := make(chan struct{})
	go func() { send(t, h2, "k2", `{}`); close(go2) }()
	require.Eventually(t, func() bool { return mem.Len() == 2 }, 10*time.Second, time.Millisecond)
	dup = send(t, h2, "k2", `{}`)
	require.Equal(t, http.StatusConflict, dup.Code)
	require.Equal(t, "1", dup.Header().Get("Retry-After"))
	require.EqualValues(t, 4, slept.Load())
	close(gate2)
	<-go2
}

// claimed unpacks a Claim's result as (record, acquired, error).
func claimed(res ClaimResult, err error) (Record, bool, error) {
	return res.Record, res.Acquired(), err
}
