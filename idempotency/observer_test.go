package idempotency_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
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

// seen records every event an Observer gets, by function.
type seen struct {
	mu     sync.Mutex
	events []string
	byKind map[string][]idempotency.Event
}

func (s *seen) add(kind string) func(context.Context, idempotency.Event) {
	return func(_ context.Context, e idempotency.Event) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.byKind == nil {
			s.byKind = map[string][]idempotency.Event{}
		}
		s.events = append(s.events, kind)
		s.byKind[kind] = append(s.byKind[kind], e)
	}
}

func (s *seen) observer() idempotency.Observer {
	return idempotency.Observer{
		Claimed: s.add("claimed"), Executed: s.add("executed"), Replayed: s.add("replayed"),
		Refused: s.add("refused"), StoreCall: s.add("store"),
	}
}

func (s *seen) take() ([]string, map[string][]idempotency.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, by := s.events, s.byKind
	s.events, s.byKind = nil, nil
	return ev, by
}

func created(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusCreated)
	w.Write([]byte(`{"id":1}`))
}

func TestObserverSeesClaimExecutionReplayAndConflicts(t *testing.T) {
	s := &seen{}
	other := &seen{}
	srv := serve(t, memstore.New(), http.HandlerFunc(created),
		idempotency.WithObserver(s.observer()), idempotency.WithObserver(other.observer()))

	first := post(t, srv, "k1", `{"amount":10}`)
	require.Equal(t, http.StatusCreated, first.Status)
	ev, by := s.take()
	assert.Equal(t, []string{"store", "claimed", "store", "executed"}, ev)
	assert.Equal(t, idempotency.OpClaim, by["store"][0].Op)
	assert.Equal(t, idempotency.OpComplete, by["store"][1].Op)
	assert.NoError(t, by["store"][1].Err)
	assert.Equal(t, idempotency.ClaimCreated, by["claimed"][0].Claim)
	assert.Equal(t, int64(1), by["claimed"][0].Generation)
	ex := by["executed"][0]
	assert.Equal(t, idempotency.OutcomeCompleted, ex.Outcome)
	assert.Equal(t, http.StatusCreated, ex.Status)
	assert.Equal(t, "k1", ex.Scope.Key)
	assert.Positive(t, ex.Duration)
	ev2, _ := other.take()
	assert.Equal(t, ev, ev2, "observers compose: the second sees every event too")

	requireReplay(t, post(t, srv, "k1", `{"amount":10}`), first)
	ev, by = s.take()
	assert.Equal(t, []string{"store", "replayed"}, ev)
	assert.Equal(t, http.StatusCreated, by["replayed"][0].Status)

	requireProblem(t, post(t, srv, "k1", `{"amount":99}`), http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	ev, by = s.take()
	assert.Equal(t, []string{"store", "refused"}, ev)
	assert.Equal(t, idempotency.CodeKeyReused, by["refused"][0].Code)
	assert.Equal(t, http.StatusUnprocessableEntity, by["refused"][0].Status)
}

func TestObserverSeesInProgressConflictAndRelease(t *testing.T) {
	s := &seen{}
	entered, release := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		w.WriteHeader(http.StatusServiceUnavailable) // not stored: the key is released
	})
	srv := serve(t, memstore.New(), h, idempotency.WithObserver(s.observer()),
		idempotency.WithMaxInProgressWait(0))
	done := make(chan answer)
	go func() { a, _ := tryDo(http.MethodPost, srv.URL+"/payments", "k2", `{}`); done <- a }()
	<-entered
	requireProblem(t, post(t, srv, "k2", `{}`), http.StatusConflict, idempotency.CodeInProgress)
	close(release)
	require.Equal(t, http.StatusServiceUnavailable, (<-done).Status)

	_, by := s.take()
	require.Len(t, by["refused"], 1)
	assert.Equal(t, idempotency.CodeInProgress, by["refused"][0].Code)
	assert.Equal(t, http.StatusConflict, by["refused"][0].Status)
	require.Len(t, by["executed"], 1)
	assert.Equal(t, idempotency.OutcomeReleased, by["executed"][0].Outcome)
	assert.Equal(t, http.StatusServiceUnavailable, by["executed"][0].Status)
	var ops []idempotency.Op
	for _, e := range by["store"] {
		ops = append(ops, e.Op)
	}
	assert.Contains(t, ops, idempotency.OpRelease)
}

// slowFailingStore fails every call after a measurable delay.
type slowFailingStore struct{ failingStore }

func (slowFailingStore) Claim(context.Context, idempotency.Claim) (idempotency.ClaimResult, error) {
	time.Sleep(2 * time.Millisecond)
	return idempotency.ClaimResult{}, errStore
}

func TestObserverSeesStoreErrorsWithTheirLatency(t *testing.T) {
	s := &seen{}
	srv := serve(t, slowFailingStore{}, http.HandlerFunc(created), idempotency.WithObserver(s.observer()))
	requireProblem(t, post(t, srv, "k3", `{}`), http.StatusServiceUnavailable, idempotency.CodeStoreUnavailable)
	ev, by := s.take()
	// The claim, then the read that tells whether it applied before it
	// failed.
	assert.Equal(t, []string{"store", "store", "refused"}, ev)
	assert.Equal(t, idempotency.CodeStoreUnavailable, by["refused"][0].Code)
	assert.ErrorIs(t, by["refused"][0].Err, errStore)
	assert.Equal(t, idempotency.OpClaim, by["store"][0].Op)
	assert.Equal(t, idempotency.OpGet, by["store"][1].Op)
	assert.True(t, errors.Is(by["store"][0].Err, errStore))
	assert.GreaterOrEqual(t, by["store"][0].Duration, 2*time.Millisecond)
}

func TestObserverSeesATakeover(t *testing.T) {
	s := &seen{}
	store := memstore.New()
	body := `{"amount":10}`
	scope := idempotency.Scope{Method: http.MethodPost, Route: "POST /payments", Key: "k4"}
	// A first execution whose lease expired an hour ago, for the same request.
	res, err := store.Claim(t.Context(), idempotency.Claim{
		Scope: scope, Owner: "crashed", Now: time.Now().Add(-time.Hour), LeaseFor: time.Second,
		Fingerprint: idempotency.Fingerprint(idempotency.FingerprintVersion, http.MethodPost, "POST /payments", "/payments", "",
			"application/json", []byte(body)),
		FingerprintVersion: idempotency.FingerprintVersion, ReplayWindow: time.Hour,
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	// The requests below carry no credentials: the anonymous scope ("").
	srv := serve(t, store, http.HandlerFunc(created), idempotency.WithObserver(s.observer()), idempotency.WithAnonymousKeys(true))
	require.Equal(t, http.StatusCreated, post(t, srv, "k4", body, "Authorization:").Status)
	_, by := s.take()
	require.Len(t, by["claimed"], 1)
	assert.Equal(t, idempotency.ClaimTakenOver, by["claimed"][0].Claim)
	assert.Equal(t, int64(2), by["claimed"][0].Generation)
	assert.Equal(t, int64(2), by["executed"][0].Generation)
}

// Heartbeats are store calls too: a handler that outlives a third of its
// lease is seen beating (OpHeartbeat), each beat with its latency.
func TestObserverSeesHeartbeats(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &seen{}
		h := idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true),
			idempotency.WithLease(3*time.Second), idempotency.WithObserver(s.observer())).Wrap(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(2500 * time.Millisecond) // two beats: at 1 s and 2 s
				created(w, r)
			}))
		req := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, req)
		require.Equal(t, http.StatusCreated, rr.Code)
		_, by := s.take()
		var ops []idempotency.Op
		for _, e := range by["store"] {
			ops = append(ops, e.Op)
			require.NoError(t, e.Err)
		}
		assert.Equal(t, []idempotency.Op{idempotency.OpClaim, idempotency.OpHeartbeat, idempotency.OpHeartbeat, idempotency.OpComplete}, ops)
	})
}

// An observer that panics when a request claims its key does not leave the
// key claimed: the execution gives it up, so that the client's retry runs
// at once instead of getting 409 until the lease expires.
func TestObserverPanicAtClaimGivesTheKeyUp(t *testing.T) {
	var panicked atomic.Bool
	srv := serve(t, memstore.New(), http.HandlerFunc(created), idempotency.WithObserver(idempotency.Observer{
		Claimed: func(context.Context, idempotency.Event) {
			if panicked.CompareAndSwap(false, true) {
				panic("observer bug")
			}
		},
	}))
	_, err := tryDo(http.MethodPost, srv.URL+"/payments", "k-panic", `{}`)
	require.Error(t, err, "net/http drops the connection of a handler that panicked")
	require.True(t, panicked.Load())
	a := post(t, srv, "k-panic", `{}`)
	require.Equal(t, http.StatusCreated, a.Status, "body: %s", a.Body)
	requireFresh(t, a)
}

// A handler whose record a successor took over while it ran, and whose
// answer is not stored, lost its lease: it is reported as OutcomeLost (not
// released, since the record is the successor's), and its client is told
// to retry (409) instead of getting the unstored failure.
func TestUnstoredAnswerAfterATakeoverIsLost(t *testing.T) {
	mem := memstore.New()
	s := &seen{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := idempotency.FromContext(r.Context())
		rec, err := mem.Get(r.Context(), run.Scope)
		require.NoError(t, err)
		// The lease ends (a stall), and a successor takes the record over.
		now := time.Now()
		require.NoError(t, mem.Heartbeat(r.Context(), run.Lease, now)) // ends the lease
		res, err := mem.Claim(r.Context(), idempotency.Claim{Scope: run.Scope, Fingerprint: rec.Fingerprint,
			FingerprintVersion: rec.FingerprintVersion, Owner: "successor", Now: now.Add(time.Millisecond),
			LeaseFor: time.Minute})
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimTakenOver, res.Outcome)
		w.WriteHeader(http.StatusBadGateway)
	})
	srv := serve(t, mem, h, idempotency.WithObserver(s.observer()))
	requireProblem(t, post(t, srv, "k-lost", `{}`), http.StatusConflict, idempotency.CodeInProgress)
	_, by := s.take()
	require.Len(t, by["executed"], 1)
	require.Equal(t, idempotency.OutcomeLost, by["executed"][0].Outcome)
	require.ErrorIs(t, by["executed"][0].Err, idempotency.ErrLeaseLost)
	rec, err := mem.Get(t.Context(), idempotency.Scope{Principal: by["executed"][0].Scope.Principal,
		Method: "POST", Route: "POST /payments", Key: "k-lost"})
	require.NoError(t, err)
	require.Equal(t, "successor", rec.Owner, "the successor's record is left alone")
}
