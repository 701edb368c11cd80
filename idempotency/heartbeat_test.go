package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Heartbeats keep a long handler's lease alive (no takeover), stop when it
// returns, and a lost lease cancels the handler's context with cause
// ErrLeaseLost. testing/synctest provides the fake time.
func TestHeartbeat(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var calls atomic.Int64
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				time.Sleep(95 * time.Second) // three leases long
			}
			w.WriteHeader(http.StatusCreated)
		})
		h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
		done := make(chan int)
		go func() { done <- send(t, h, "k", `{}`).Code }()
		time.Sleep(61 * time.Second)
		synctest.Wait()
		rec, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
		require.NoError(t, err)
		require.True(t, rec.LeaseUntil.After(time.Now()), "heartbeats did not extend the lease")
		// A duplicate after two lease lengths still finds it in progress.
		dup := send(t, h, "k", `{}`)
		require.Equal(t, http.StatusConflict, dup.Code)
		require.Equal(t, http.StatusCreated, <-done)
		require.EqualValues(t, 1, calls.Load())
	})

	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		cause := make(chan error, 1)
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
			cause <- context.Cause(r.Context())
			http.Error(w, "canceled", http.StatusServiceUnavailable)
		})
		h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
		done := make(chan *httptest.ResponseRecorder)
		go func() { done <- send(t, h, "k", `{}`) }()
		synctest.Wait()
		// Someone else removes the record (as a successor would take it).
		rec, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
		require.NoError(t, err)
		require.NoError(t, mem.Release(t.Context(), rec.Lease()))
		time.Sleep(11 * time.Second) // the next heartbeat finds the lease lost
		require.ErrorIs(t, <-cause, idempotency.ErrLeaseLost)
		require.Equal(t, http.StatusServiceUnavailable, (<-done).Code)
	})
}

// beatFails is a memstore.Store whose heartbeats fail (store unreachable)
// while fail reports true for the beat's number (1, 2, ...).
type beatFails struct {
	*memstore.Store
	beats atomic.Int64
	fail  func(n int64) bool
}

func (b *beatFails) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	if b.fail(b.beats.Add(1)) {
		return errBoom
	}
	return b.Store.Heartbeat(ctx, l, until)
}

// Heartbeats that keep failing cancel the handler with cause
// ErrLeaseExpired before its lease can run out (a successor could otherwise
// run the request a second time alongside it) and no phase may start; what
// it did is still completed, fenced, so that it is never repeated. One
// failed beat alone cancels nothing. testing/synctest provides the fake time.
func TestHeartbeatFailuresStopTheHandlerBeforeTheLeaseEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &beatFails{Store: memstore.New(), fail: func(int64) bool { return true }}
		start := time.Now()
		var (
			cause      error
			canceledAt time.Duration
			phaseErr   error
		)
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
				cause, canceledAt = context.Cause(r.Context()), time.Since(start)
			case <-time.After(2 * time.Minute):
			}
			run, _ := idempotency.FromContext(r.Context())
			_, phaseErr = run.Phase(r.Context(), "late", func(context.Context) ([]byte, error) { return []byte("x"), nil })
			w.WriteHeader(http.StatusCreated) // a handler that ignores its cancellation
			io.WriteString(w, "charged")
		})
		h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
		a := send(t, h, "k", `{}`)

		require.ErrorIs(t, cause, idempotency.ErrLeaseExpired)
		require.ErrorIs(t, cause, idempotency.ErrLeaseLost, "the expiry matches ErrLeaseLost")
		require.ErrorIs(t, cause, errBoom, "and the store's error")
		require.Greater(t, canceledAt, 10*time.Second, "one failed heartbeat does not cancel")
		require.Less(t, canceledAt, 30*time.Second, "canceled before the lease ran out")
		require.ErrorIs(t, phaseErr, idempotency.ErrLeaseExpired, "no phase may start after the cancellation")
		var pe *idempotency.PhaseError
		require.ErrorAs(t, phaseErr, &pe)
		require.Equal(t, "lease", pe.Step)
		// No successor took the record over: the fenced completion stores
		// the work that was done, so a retry replays it instead of charging
		// again (releasing the key here would invite a duplicate).
		require.Equal(t, http.StatusCreated, a.Code, a.Body.String())
		rec, err := store.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, rec.State)
		require.Equal(t, "charged", string(rec.Response.Body))
	})

	synctest.Test(t, func(t *testing.T) {
		store := &beatFails{Store: memstore.New(), fail: func(n int64) bool { return n == 1 || n == 3 }}
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(95 * time.Second) // beats 1 and 3 fail, 2 and 4 get through
			if err := context.Cause(r.Context()); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
		require.Equal(t, http.StatusCreated, send(t, h, "k", `{}`).Code)
		rec, err := store.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, rec.State)
	})
}

// beatLog is a memstore.Store that records when each key's lease was extended.
type beatLog struct {
	*memstore.Store
	start time.Time
	mu    sync.Mutex
	beats map[string][]time.Duration
}

func (b *beatLog) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	b.mu.Lock()
	b.beats[l.Scope.Key] = append(b.beats[l.Scope.Key], time.Since(b.start))
	b.mu.Unlock()
	return b.Store.Heartbeat(ctx, l, until)
}

// A run beats at lease/3 after it started and every lease/3 after that,
// until its handler returns: a run that ends before its first beat never
// beats. testing/synctest provides the fake time.
func TestHeartbeatEveryThirdOfTheLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &beatLog{Store: memstore.New(), start: time.Now(), beats: map[string][]time.Duration{}}
		runFor := map[string]time.Duration{"z": time.Second, "a": 5 * time.Second, "b": 15 * time.Second, "c": 35 * time.Second, "d": 9 * time.Second}
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(runFor[r.Header.Get("Idempotency-Key")])
			w.WriteHeader(http.StatusCreated)
		})
		h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
		require.Equal(t, http.StatusCreated, send(t, h, "z", `{}`).Code)
		store.start = time.Now()
		var wg sync.WaitGroup
		for _, k := range []string{"a", "b", "c", "d"} {
			wg.Go(func() { require.Equal(t, http.StatusCreated, send(t, h, k, `{}`).Code) })
			time.Sleep(time.Second) // a at 0 s, b at 1 s, c at 2 s, d at 3 s
		}
		wg.Wait()
		store.mu.Lock()
		defer store.mu.Unlock()
		require.Equal(t, map[string][]time.Duration{
			"b": {11 * time.Second},
			"c": {12 * time.Second, 22 * time.Second, 32 * time.Second},
		}, store.beats, "a and d ended before their first beat")
	})
}

// A handler used outside a testing/synctest bubble, then inside two
// bubbles in turn, then outside again (a user's tests sharing one handler)
// beats on each clock: every run's timer is made on the clock of the
// goroutine that runs it.
func TestHeartbeatsAcrossSyncTestBubbles(t *testing.T) {
	store := &beatLog{Store: memstore.New(), start: time.Now(), beats: map[string][]time.Duration{}}
	var runFor atomic.Int64
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(runFor.Load()))
		w.WriteHeader(http.StatusCreated)
	})
	h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)
	for i := range 200 {
		require.Equal(t, http.StatusCreated, send(t, h, fmt.Sprint("outside-", i), `{}`).Code)
	}
	for _, key := range []string{"bubble-1", "bubble-2"} {
		synctest.Test(t, func(t *testing.T) {
			store.mu.Lock()
			store.start = time.Now()
			store.mu.Unlock()
			runFor.Store(int64(35 * time.Second))
			require.Equal(t, http.StatusCreated, send(t, h, key, `{}`).Code)
			runFor.Store(0)
		})
	}
	require.Equal(t, http.StatusCreated, send(t, h, "outside-after", `{}`).Code)
	store.mu.Lock()
	defer store.mu.Unlock()
	require.Equal(t, []time.Duration{10 * time.Second, 20 * time.Second, 30 * time.Second}, store.beats["bubble-1"])
	require.Equal(t, []time.Duration{10 * time.Second, 20 * time.Second, 30 * time.Second}, store.beats["bubble-2"])
}

// lateBeatStore holds the middleware's first heartbeat until the lease is
// ended at once (a heartbeat to now, as for a resume) or 100 ms pass.
type lateBeatStore struct {
	*memstore.Store
	once, ended sync.Once
	inFlight    chan struct{}
	release     chan struct{}
}

func (s *lateBeatStore) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	if !until.After(time.Now()) { // the lease ends
		err := s.Store.Heartbeat(ctx, l, until)
		s.ended.Do(func() { close(s.release) })
		return err
	}
	first := false
	s.once.Do(func() { first = true })
	if first {
		close(s.inFlight)
		select {
		case <-s.release:
		case <-time.After(100 * time.Millisecond):
		}
	}
	return s.Store.Heartbeat(ctx, l, until)
}

// A record kept for a resume (a phase committed, then an unstored answer)
// has its lease ended at once, so that the client's retry takes it over. A
// heartbeat still in flight when the handler returned must not extend it
// again afterwards: the middleware waits for it before ending the lease.
func TestLateHeartbeatDoesNotReExtendAnEndedLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &lateBeatStore{Store: memstore.New(), inFlight: make(chan struct{}), release: make(chan struct{})}
		mw := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLease(300*time.Millisecond), idempotency.WithLogger(quiet))
		h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			_, err := run.Phase(r.Context(), "p1", func(context.Context) ([]byte, error) { return []byte("x"), nil })
			require.NoError(t, err)
			<-s.inFlight                                  // the first beat is in flight
			w.WriteHeader(http.StatusInternalServerError) // unstored: the record is kept, its lease ended
		}))
		req := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("a"))
		req.Header.Set("Idempotency-Key", "k")
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, req)
		synctest.Wait() // the late beat, if any, has landed
		rec, err := s.Get(context.Background(), idempotency.Scope{Method: http.MethodPost, Route: "/pay", Key: "k"})
		require.NoError(t, err)
		require.Equal(t, http.StatusInternalServerError, rr.Code)
		require.Equal(t, idempotency.InProgress, rec.State)
		require.False(t, rec.LeaseUntil.After(time.Now()), "the ended lease was extended again by %v", time.Until(rec.LeaseUntil))
	})
}

// slowBeat is a memstore whose heartbeats take 40 ms.
type slowBeat struct{ *memstore.Store }

func (s slowBeat) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	time.Sleep(40 * time.Millisecond)
	return s.Store.Heartbeat(ctx, l, until)
}

// A heartbeat still in flight when the response is stored finds the lease
// gone (the record is completed): that is no lost lease, and nothing says
// so at Warn. The observers see the beat, with ErrLeaseLost, an answer.
func TestLateHeartbeatAfterCompletionIsNoLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		log, buf := bufLogger()
		s := &seen{}
		h := idempotency.New(slowBeat{memstore.New()}, idempotency.WithAnonymousKeys(true),
			idempotency.WithLease(300*time.Millisecond), idempotency.WithLogger(log),
			idempotency.WithObserver(s.observer())).
			Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(120 * time.Millisecond) // the beat at 100 ms ends at 140 ms
				w.WriteHeader(http.StatusCreated)
			}))
		require.Equal(t, http.StatusCreated, send(t, h, "k", `{}`).Code)
		time.Sleep(time.Second)
		synctest.Wait()
		require.Contains(t, buf.String(), `level=DEBUG msg="idempotency: the response was stored"`)
		require.NotContains(t, buf.String(), "level=WARN", "a completed request logged as a lost lease")
		_, by := s.take()
		require.Equal(t, idempotency.OutcomeCompleted, by["executed"][0].Outcome)
		for _, e := range by["store"] {
			if e.Op == idempotency.OpHeartbeat && e.Err != nil {
				require.ErrorIs(t, e.Err, idempotency.ErrLeaseLost)
				continue
			}
			require.NoError(t, e.Err, "store call %s", e.Op)
		}
	})
}
