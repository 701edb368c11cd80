package idempotency

import (
	"github.com/saferetry/saferetry/keygen"

	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// crashed leaves the state a server that died while serving a request
// leaves: an in-progress record with the request saved at the claim, the
// phases given committed (recovery data as Phase writes it), and a lease
// that is never renewed. The fingerprint is the middleware's, so a later
// client retry of the same request matches it.
func crashed(t *testing.T, s Store, sc Scope, path, body string, now time.Time, phases ...CommittedPhase) Record {
	t.Helper()
	rec, ok, err := claimed(s.Claim(t.Context(), Claim{
		Scope:              sc,
		Fingerprint:        Fingerprint(sc.Method, sc.Route, path, "", "application/json", []byte(body)),
		FingerprintVersion: FingerprintVersion,
		Owner:              "dead-owner",
		Request: StoredRequest{ID: "0123456789abcdef", Method: sc.Method, URL: path, Host: "shop.example",
			ContentType: "application/json", Body: []byte(body)}.Encode(),
		Now: now, LeaseFor: 30 * time.Second, ReplayWindow: DefaultReplayWindow,
	}))
	require.NoError(t, err)
	require.True(t, ok)
	if len(phases) > 0 {
		point := phases[len(phases)-1].Name
		require.NoError(t, s.SetRecoveryPoint(t.Context(), rec.Lease(), point, Recovery{Phases: phases}.Encode(), now))
		rec.RecoveryPoint = point
	}
	return rec
}

func newTestCompleter(s Store, clock *fakeClock, routes map[string]http.Handler, cfg CompleterConfig) *Completer {
	cfg.Routes = routes
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	c := NewCompleter(s, cfg)
	c.now = clock.Now
	return c
}

var shopScope = Scope{Method: "POST", Route: "POST /payments", Key: "order-42"}

// Acceptance 3 on the memory store: a request abandoned after its order
// phase, with no client retry, is completed by the completer once its lease
// expired (not before); the order is not created again, the card charged
// once, and a later client retry gets the stored response as a replay.
func TestCompleterFinishesAnAbandonedRequest(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	s := newShop()
	crashed(t, mem, shopScope, "/payments", `{"amount":4200}`, t0, CommittedPhase{Name: "order", Output: []byte("ord_1")})
	c := newTestCompleter(mem, clock, map[string]http.Handler{"POST /payments": s}, CompleterConfig{})

	rep, err := c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{}, rep, "the lease is still alive")

	clock.Advance(31 * time.Second)
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 1, Completed: 1}, rep)
	require.Zero(t, s.runs.Load(), "the order phase was not run again")
	calls, lookups := s.proc.counts()
	require.Equal(t, map[string]int{"order-42-charge-0123456789abcdef": 1}, calls)
	require.Empty(t, lookups)
	_, receipts := s.state()
	require.Equal(t, []string{"rcpt_ord_1_ch_1"}, receipts)

	rec, err := mem.Get(t.Context(), shopScope)
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
	require.EqualValues(t, 2, rec.Generation)
	require.Equal(t, http.StatusCreated, rec.Response.Status)
	require.Equal(t, "application/json", rec.Response.Header.Get("Content-Type"))

	// The client's retry, through the middleware, replays it.
	mux := http.NewServeMux()
	mux.Handle("POST /payments", New(mem, WithAnonymousKeys(), withClock(clock), WithLogger(discard))(s))
	replay := send(t, mux, "order-42", `{"amount":4200}`)
	require.Equal(t, http.StatusCreated, replay.Code)
	requireReplayed(t, replay, `{"order":"ord_1","charge":"ch_1","receipt":"rcpt_ord_1_ch_1"}`)

	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{}, rep, "nothing left")
}

// The completer rebuilds the request: method, URL and query, host, content
// type and body, the ServeMux pattern and its path values; no credentials.
func TestCompleterRebuildsTheRequest(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	sc := Scope{Principal: "acct-1", Method: "PATCH", Route: "PATCH /payments/{id}", Key: "k"}
	crashed(t, mem, sc, "/payments/p-7?capture=true", `{"a":1}`, t0)
	var seen string
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, ok := FromContext(r.Context())
		require.True(t, ok)
		b := make([]byte, 64)
		n, _ := r.Body.Read(b)
		seen = fmt.Sprintf("%s %s %s %s %s %q %s %s auth=%q %s", r.Method, r.URL.Path, r.URL.RawQuery, r.Host,
			r.Header.Get("Content-Type"), b[:n], r.Pattern, r.PathValue("id"), r.Header.Get("Authorization"), run.Scope.Principal)
		w.WriteHeader(http.StatusOK)
	})
	c := newTestCompleter(mem, clock, map[string]http.Handler{sc.Route: h}, CompleterConfig{})
	clock.Advance(time.Minute)
	rep, err := c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Completed)
	require.Equal(t, `PATCH /payments/p-7 capture=true shop.example application/json "{\"a\":1}" PATCH /payments/{id} p-7 auth="" acct-1`, seen)

	// A route that is not a ServeMux pattern: the handler runs directly.
	sc2 := Scope{Principal: "acct-1", Method: "POST", Route: "payments-v2", Key: "k"}
	crashed(t, mem, sc2, "/v2/payments", `{}`, clock.Now())
	var pattern atomic.Value
	c = newTestCompleter(mem, clock, map[string]http.Handler{sc2.Route: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pattern.Store(r.Pattern + " " + r.URL.Path)
		w.WriteHeader(http.StatusCreated)
	})}, CompleterConfig{})
	clock.Advance(time.Minute)
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Completed)
	require.Equal(t, "payments-v2 /v2/payments", pattern.Load())
}

// Every listed record is counted once: completed, released, kept, skipped
// or failed.
func TestCompleterOutcomes(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	scope := func(route, key string) Scope { return Scope{Method: "POST", Route: route, Key: key} }
	routes := map[string]http.Handler{
		"POST /ok": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }),
		"POST /fails": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusServiceUnavailable)
		}),
		"POST /panics": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { panic("handler bug") }),
	}
	crashed(t, mem, scope("POST /ok", "a"), "/ok", `{}`, t0)
	crashed(t, mem, scope("POST /fails", "released"), "/fails", `{}`, t0.Add(1*time.Second))
	crashed(t, mem, scope("POST /fails", "kept"), "/fails", `{}`, t0.Add(2*time.Second), CommittedPhase{Name: "order"})
	crashed(t, mem, scope("POST /panics", "p"), "/panics", `{}`, t0.Add(3*time.Second), CommittedPhase{Name: "order"})
	crashed(t, mem, scope("POST /unknown", "u"), "/unknown", `{}`, t0.Add(4*time.Second))
	bad, _, err := claimed(mem.Claim(t.Context(), Claim{Scope: scope("POST /ok", "bad"), Fingerprint: "fp", Owner: "x",
		Request: []byte("not json"), Now: t0.Add(5 * time.Second), LeaseFor: 30 * time.Second}))
	require.NoError(t, err)
	require.EqualValues(t, 1, bad.Generation)

	log, buf := bufLogger()
	c := newTestCompleter(mem, clock, routes, CompleterConfig{Logger: log})
	clock.Advance(time.Minute)
	rep, err := c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 6, Completed: 1, Released: 1, Kept: 1, Skipped: 2, Failed: 1}, rep)
	require.Contains(t, buf.String(), "no handler for the route")
	require.Contains(t, buf.String(), "unreadable")
	require.Contains(t, buf.String(), "panicked")
	// Records are named by digests, never by the raw key or principal.
	require.Contains(t, buf.String(), "key_digest="+keygen.Digest("released")+" ")
	require.Contains(t, buf.String(), "principal_digest="+keygen.Digest("")+" ")
	require.NotContains(t, buf.String(), "key=")
	require.NotContains(t, buf.String(), "principal=")

	_, err = mem.Get(t.Context(), scope("POST /fails", "released"))
	require.ErrorIs(t, err, ErrNotFound, "no phase committed: released")
	kept, err := mem.Get(t.Context(), scope("POST /fails", "kept"))
	require.NoError(t, err)
	require.Equal(t, InProgress, kept.State)
	require.False(t, kept.LeaseUntil.After(clock.Now()), "kept with its lease ended, to resume")
	p, err := mem.Get(t.Context(), scope("POST /panics", "p"))
	require.NoError(t, err)
	require.Equal(t, "order", p.RecoveryPoint, "a panic after a phase keeps the record")

	// The next run skips what it cannot resume, and backs off from what it
	// failed to finish; once the wait is over it retries those; records it
	// skips do not take the batch's places.
	c.cfg.BatchSize = 1
	clock.Advance(time.Millisecond) // a lease ended at now expires after now
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 4, Skipped: 4}, rep, "two remembered, two backing off")
	clock.Advance(2 * DefaultCompleteInterval) // the wait after one failure
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 4, Skipped: 3, Kept: 1}, rep, "two remembered, one taken, the panicking one waits")
}

// A record the completer keeps failing to finish is tried again after
// Interval*2^n, capped at MaxBackoff, not at every run; a client retry is
// not delayed by it, and a record that completes is forgotten.
func TestCompleterBacksOffFromRecordsItFailsToFinish(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	var calls atomic.Int64
	var healthy atomic.Bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if !healthy.Load() {
			w.WriteHeader(http.StatusBadGateway) // the downstream service is down
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	crashed(t, mem, shopScope, "/payments", `{}`, t0, CommittedPhase{Name: "order"})
	clock.Advance(time.Minute)
	c := newTestCompleter(mem, clock, map[string]http.Handler{"POST /payments": h},
		CompleterConfig{Interval: time.Minute, MaxBackoff: 5 * time.Minute})
	run := func() CompleterReport {
		t.Helper()
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		return rep
	}
	require.Equal(t, 1, run().Kept) // failure 1: wait 2 min
	tried := []int64{calls.Load()}
	// Every minute for 15 minutes: tried at +2, +6 (4 min), +11 (8 min capped to 5).
	for range 15 {
		clock.Advance(time.Minute)
		rep := run()
		require.Equal(t, 1, rep.Found)
		tried = append(tried, calls.Load())
	}
	require.Equal(t, []int64{1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4}, tried)

	// A client retry resumes at once, backoff or not.
	healthy.Store(true)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", New(mem, WithAnonymousKeys(), withClock(clock), WithLogger(discard))(h))
	clock.Advance(time.Millisecond)
	require.Equal(t, http.StatusCreated, send(t, mux, "order-42", `{}`).Code)
	require.Equal(t, CompleterReport{}, run())
	require.Empty(t, c.backoff, "forgotten once no longer listed")

	// A completed record ends its backoff.
	crashed(t, mem, Scope{Method: "POST", Route: "POST /payments", Key: "k2"}, "/payments", `{}`, clock.Now(), CommittedPhase{Name: "order"})
	healthy.Store(false)
	clock.Advance(time.Minute)
	require.Equal(t, 1, run().Kept)
	require.Len(t, c.backoff, 1)
	healthy.Store(true)
	clock.Advance(2 * time.Minute)
	require.Equal(t, 1, run().Completed)
	require.Empty(t, c.backoff)
}

// A record that went away between the listing and the claim is not
// recreated; a record someone else took first is left alone.
func TestCompleterRaces(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	ran := atomic.Int64{}
	routes := map[string]http.Handler{"POST /payments": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran.Add(1)
	})}
	rec := crashed(t, mem, shopScope, "/payments", `{}`, t0)
	clock.Advance(time.Minute)

	// Gone: released by its owner after the listing.
	gone := &listOnly{MemoryStore: mem, before: func() { require.NoError(t, mem.Release(t.Context(), rec.Lease())) }}
	c := newTestCompleter(gone, clock, routes, CompleterConfig{})
	rep, err := c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 1, Skipped: 1}, rep)
	require.Zero(t, mem.Len(), "no record was left behind")
	require.Zero(t, gone.created, "the completer's claim never creates a record (Claim.TakeoverOnly)")
	require.Zero(t, ran.Load())

	// Taken: a client retry took it over after the listing.
	rec = crashed(t, mem, shopScope, "/payments", `{}`, clock.Now())
	clock.Advance(time.Minute)
	taken := &listOnly{MemoryStore: mem, before: func() {
		_, ok, err := claimed(mem.Claim(t.Context(), Claim{Scope: rec.Scope, Fingerprint: rec.Fingerprint,
			FingerprintVersion: rec.FingerprintVersion, Owner: "client-retry", Now: clock.Now(), LeaseFor: time.Minute}))
		require.NoError(t, err)
		require.True(t, ok)
	}}
	c = newTestCompleter(taken, clock, routes, CompleterConfig{})
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 1, Skipped: 1}, rep)
	got, err := mem.Get(t.Context(), rec.Scope)
	require.NoError(t, err)
	require.Equal(t, "client-retry", got.Owner)
	require.Zero(t, ran.Load())

	// Completed long ago (out of the replay window) and listed by a stale
	// read: the completer's claim never restarts a completed record.
	require.NoError(t, mem.Complete(t.Context(), got.Lease(), Response{Status: 201}, clock.Now()))
	clock.Advance(48 * time.Hour)
	stale := &staleList{MemoryStore: mem, rec: got}
	c = newTestCompleter(stale, clock, routes, CompleterConfig{})
	rep, err = c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, CompleterReport{Found: 1, Skipped: 1}, rep)
	got, err = mem.Get(t.Context(), rec.Scope)
	require.NoError(t, err)
	require.Equal(t, Completed, got.State)
	require.Zero(t, ran.Load())
}

// listOnly runs before after listing, and counts the claims that created a
// record.
type listOnly struct {
	*MemoryStore
	before  func()
	created int
}

func (l *listOnly) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	res, err := l.MemoryStore.Claim(ctx, c)
	if res.Outcome == ClaimCreated {
		l.created++
	}
	return res, err
}

func (l *listOnly) Abandoned(ctx context.Context, now time.Time, limit int) ([]Record, error) {
	recs, err := l.MemoryStore.Abandoned(ctx, now, limit)
	l.before()
	return recs, err
}

// staleList lists rec whatever the store holds.
type staleList struct {
	*MemoryStore
	rec Record
}

func (s *staleList) Abandoned(context.Context, time.Time, int) ([]Record, error) {
	return []Record{s.rec}, nil
}

type claimFails struct{ *MemoryStore }

func (claimFails) Claim(context.Context, Claim) (ClaimResult, error) {
	return ClaimResult{}, errBoom
}

func TestCompleterStoreErrors(t *testing.T) {
	clock := &fakeClock{t: t0}
	routes := map[string]http.Handler{"POST /payments": http.NotFoundHandler()}
	c := newTestCompleter(failingStore{Store: NewMemoryStore(), fail: "abandoned"}, clock, routes, CompleterConfig{})
	_, err := c.RunOnce(t.Context())
	require.ErrorIs(t, err, ErrCompleter)
	require.ErrorIs(t, err, errBoom)
	var ce *CompleterError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "abandoned", ce.Op)
	require.Equal(t, "idempotency: completer: abandoned: boom", err.Error())

	mem := NewMemoryStore()
	crashed(t, mem, shopScope, "/payments", `{}`, t0)
	clock.Advance(time.Minute)
	c = newTestCompleter(claimFails{mem}, clock, routes, CompleterConfig{})
	rep, err := c.RunOnce(t.Context())
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "claim", ce.Op)
	require.Equal(t, shopScope, ce.Scope)
	require.Equal(t, 1, rep.Found)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	c = newTestCompleter(mem, clock, routes, CompleterConfig{})
	_, err = c.RunOnce(ctx)
	require.ErrorIs(t, err, context.Canceled)
}

func TestCompleterDefaults(t *testing.T) {
	c := NewCompleter(NewMemoryStore(), CompleterConfig{BatchSize: -1, Interval: -1, Lease: time.Millisecond})
	require.Equal(t, DefaultCompleteBatch, c.cfg.BatchSize)
	require.Equal(t, DefaultCompleteInterval, c.cfg.Interval)
	require.Equal(t, DefaultLease, c.cfg.Lease)
	require.NotNil(t, c.cfg.Logger)
	// Options shape how responses are stored; Lease wins over WithLease.
	c = NewCompleter(NewMemoryStore(), CompleterConfig{Lease: time.Minute, Options: []Option{WithStore5xx(true), WithLease(time.Hour), nil}})
	require.True(t, c.mcfg.store5xx)
	require.Equal(t, time.Minute, c.mcfg.lease)
}

// Start runs at once, then on every tick, and stops cleanly (goleak checks
// the goroutines at the end of the package's tests).
func TestCompleterStart(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	var ran atomic.Int64
	routes := map[string]http.Handler{"POST /payments": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran.Add(1)
		w.WriteHeader(http.StatusCreated)
	})}
	crashed(t, mem, shopScope, "/payments", `{}`, t0)
	clock.Advance(time.Minute)
	c := newTestCompleter(mem, clock, routes, CompleterConfig{Interval: 5 * time.Second})
	ft := &fakeTicker{c: make(chan time.Time)}
	c.newTicker = func(d time.Duration) (<-chan time.Time, func()) {
		ft.period = d
		return ft.c, func() { ft.stopped.Store(true) }
	}
	runs := make(chan CompleterReport, 4)
	c.afterRun = func(rep CompleterReport, err error) {
		require.NoError(t, err)
		runs <- rep
	}
	stop := c.Start(t.Context())
	require.Equal(t, 1, (<-runs).Completed)
	require.Equal(t, 5*time.Second, ft.period)

	crashed(t, mem, Scope{Method: "POST", Route: "POST /payments", Key: "second"}, "/payments", `{}`, clock.Now())
	clock.Advance(time.Minute)
	ft.c <- clock.Now()
	require.Equal(t, 1, (<-runs).Completed)
	require.EqualValues(t, 2, ran.Load())
	stop()
	stop()
	require.True(t, ft.stopped.Load())

	// A handler running when stop is called sees its context canceled.
	crashed(t, mem, Scope{Method: "POST", Route: "POST /slow", Key: "slow"}, "/slow", `{}`, clock.Now())
	clock.Advance(time.Minute)
	started := make(chan struct{})
	c = newTestCompleter(mem, clock, map[string]http.Handler{"POST /slow": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done()
		w.WriteHeader(http.StatusServiceUnavailable)
	})}, CompleterConfig{})
	stop = c.Start(t.Context())
	<-started
	stop()
	_, err := mem.Get(t.Context(), Scope{Method: "POST", Route: "POST /slow", Key: "slow"})
	require.ErrorIs(t, err, ErrNotFound, "the canceled run released its key")
}

// The completer and a stalled original owner: the owner wakes up after the
// completer took its record over, and none of its phases commit.
func TestCompleterFencesTheStalledOwner(t *testing.T) {
	mem := NewMemoryStore()
	clock := &fakeClock{t: t0}
	s := newShop()
	stalled, resume := make(chan struct{}), make(chan struct{})
	var zombieErr atomic.Value
	first := true
	zombie := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := FromContext(r.Context())
		if first {
			first = false
			_, _ = run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return []byte("ord_z"), nil })
			close(stalled)
			<-resume
			_, err := run.External(r.Context(), "charge", s.proc.charge, s.proc.find)
			zombieErr.Store(err)
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		s.ServeHTTP(w, r)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", New(mem, WithAnonymousKeys(), withClock(clock), WithLogger(discard))(zombie))
	done := make(chan *httptest.ResponseRecorder)
	go func() { done <- send(t, mux, "order-42", `{}`) }()
	<-stalled
	clock.Advance(time.Minute)
	c := newTestCompleter(mem, clock, map[string]http.Handler{"POST /payments": zombie}, CompleterConfig{})
	rep, err := c.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Completed)
	close(resume)
	<-done
	require.ErrorIs(t, zombieErr.Load().(error), ErrLeaseLost)
	calls, _ := s.proc.counts()
	require.Len(t, calls, 1, "only the completer charged")
	for _, n := range calls {
		require.Equal(t, 1, n)
	}
	rec, err := mem.Get(t.Context(), shopScope)
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
	require.Contains(t, string(rec.Response.Body), `"order":"ord_z"`, "the completer resumed after the zombie's order")
	require.True(t, errors.Is(zombieErr.Load().(error), ErrLeaseLost))
}
