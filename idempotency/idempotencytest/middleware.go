package idempotencytest

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// middlewareTests run the middleware (idempotency.New) over the store, at
// the real clock, through the recovery paths whose guarantees rest on what
// the store keeps: names of phases and calls, a resume without
// credentials, a completion whose answer is lost, durations at their
// limits.
var middlewareTests = []suiteTest{
	{"MiddlewareRecoveryNames", testRecoveryNames, 0},
	{"MiddlewareResumeWithoutCredentials", testResumeWithoutCredentials, needsSweeper},
	{"MiddlewareCompletionAnswerLost", testCompletionAnswerLost, 0},
	{"MiddlewareDurationsAtTheirLimits", testMiddlewareDurations, needsSweeper},
}

var discard = slog.New(slog.DiscardHandler)

// post serves a guarded POST /payments with key and body through h, as the
// account acct (none when ""), and returns the answer.
func post(h http.Handler, key, acct, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	if acct != "" {
		req.Header.Set("X-Account", acct)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

// guarded returns h guarded by mw on the route "POST /payments".
func guarded(mw *idempotency.Middleware, h http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(h))
	return mux
}

func xAccount(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil }

// wantStatus fails unless w answered status, without the replay marker when
// first is set, with it otherwise.
func wantStatus(t *testing.T, what string, w *httptest.ResponseRecorder, status int, first bool) {
	t.Helper()
	replayed := w.Header().Get(idempotency.ReplayedHeader) == "true"
	if w.Code != status || replayed == first {
		t.Fatalf("%s: %d (replayed %v) %s; want %d, replayed %v", what, w.Code, replayed,
			w.Body, status, !first)
	}
}

// executed records the outcomes an Observer sees.
type executed struct {
	mu       sync.Mutex
	outcomes []idempotency.Outcome
	errs     []error
}

func (e *executed) observer() idempotency.Observer {
	return idempotency.Observer{Executed: func(_ context.Context, ev idempotency.Event) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.outcomes = append(e.outcomes, ev.Outcome)
		e.errs = append(e.errs, ev.Err)
	}}
}

// only fails unless the one execution seen ended with want.
func (e *executed) only(t *testing.T, want idempotency.Outcome) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.outcomes) != 1 || e.outcomes[0] != want {
		t.Fatalf("executions ended %v (errors %v), want one %v", e.outcomes, e.errs, want)
	}
}

// Names every byte of which the recovery data keeps, and names refused
// before anything runs (not valid UTF-8, or the prefix of an intent).
var (
	keptNames    = []string{"order café", "n\x00ul <&> \u2028", "☃"}
	refusedNames = []string{"order caf\xe9", "charge \xff", "intent:order"}
)

// testRecoveryNames: phases and External calls whose names are bytes
// round-trip through the record, or are refused (ErrMisuse) before their
// function runs; after the first execution fails (500, kept at its
// recovery point), the retry finds each committed, runs no phase again,
// makes no call twice, and completes.
func testRecoveryNames(t *testing.T, s idempotency.Store) {
	var phaseRuns, calls, executions int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		run, _ := idempotency.FromContext(ctx)
		executions++
		for _, name := range refusedNames {
			_, err := run.Phase(ctx, name, func(context.Context) ([]byte, error) {
				phaseRuns++
				return nil, nil
			})
			if !errors.Is(err, idempotency.ErrMisuse) {
				t.Errorf("Phase(%q): %v, want ErrMisuse", name, err)
			}
			_, err = run.External(ctx, name, func(context.Context, string) ([]byte, error) {
				calls++
				return nil, nil
			}, nil)
			if !errors.Is(err, idempotency.ErrMisuse) {
				t.Errorf("External(%q): %v, want ErrMisuse", name, err)
			}
		}
		for _, name := range keptNames {
			out, err := run.Phase(ctx, "phase "+name, func(context.Context) ([]byte, error) {
				phaseRuns++
				return []byte("out " + name + "\xff\xfe"), nil
			})
			if err != nil || string(out) != "out "+name+"\xff\xfe" {
				t.Errorf("Phase(%q) = %q, %v", "phase "+name, out, err)
			}
			out, err = run.External(ctx, "call "+name, func(context.Context, string) ([]byte,
				error) {
				calls++
				return []byte("res " + name), nil
			}, func(context.Context, string) ([]byte, bool, error) {
				t.Errorf("External(%q): a committed call is looked up", "call "+name)
				return nil, false, nil
			})
			if err != nil || string(out) != "res "+name {
				t.Errorf("External(%q) = %q, %v", "call "+name, out, err)
			}
		}
		if executions == 1 {
			w.WriteHeader(http.StatusInternalServerError) // kept for a resume
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	g := guarded(idempotency.New(s, idempotency.WithLogger(discard),
		idempotency.WithAnonymousKeys(true)), h)
	if w := post(g, "names", "", `{}`); w.Code != http.StatusInternalServerError {
		t.Fatalf("first execution: %d %s, want 500", w.Code, w.Body)
	}
	if phaseRuns != len(keptNames) || calls != len(keptNames) {
		t.Fatalf("first execution: %d phases ran and %d calls were made, want %d each",
			phaseRuns, calls, len(keptNames))
	}
	wantStatus(t, "the retry", post(g, "names", "", `{}`), http.StatusCreated, true)
	if phaseRuns != len(keptNames) || calls != len(keptNames) {
		t.Fatalf("after the retry: %d phase runs and %d calls, want %d each: a committed one ran "+
			"again",
			phaseRuns, calls, len(keptNames))
	}
}

// testResumeWithoutCredentials: a request whose handler sits behind an auth
// layer commits a phase, then its server dies (a panic leaves the record
// as a crash does, its lease ended). The Completer resumes it without
// credentials, as every resume is, and the auth layer answers 401: that
// refusal is never stored (CompleterReport.NeedCredentials, the record
// still in progress at its recovery point). The client's retry, with its
// credentials, resumes after the phase: one order, a 201 that is no
// replay, and the handler saw the principal, live and on the resume,
// through Run.Scope.
func testResumeWithoutCredentials(t *testing.T, s idempotency.Store) {
	var orders, executions int
	var principals []string
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := idempotency.FromContext(r.Context())
		executions++
		principals = append(principals, run.Scope.Principal)
		_, err := run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) {
			orders++
			return []byte("ord_1"), nil
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if executions == 1 {
			panic(http.ErrAbortHandler) // the server dies after the phase
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("charged " + run.Scope.Principal))
	})
	authenticated := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Account") == "" {
			http.Error(w, "no credentials", http.StatusUnauthorized)
			return
		}
		inner.ServeHTTP(w, r)
	})
	mw := idempotency.New(s, idempotency.WithPrincipal(xAccount), idempotency.WithLogger(discard))
	g := guarded(mw, authenticated)
	func() {
		defer func() {
			if p := recover(); p != http.ErrAbortHandler {
				t.Fatalf("the first execution: recovered %v, want its panic", p)
			}
		}()
		post(g, "resume", "acct-1", `{"amount":4200}`)
	}()
	sc := idempotency.Scope{Principal: "acct-1", Method: http.MethodPost,
		Route: "POST /payments", Key: "resume"}
	c := mw.Completer(map[string]http.Handler{"POST /payments": authenticated})
	rep, err := c.RunOnce(ctx(t))
	noErr(t, "Completer.RunOnce", err)
	if rep != (idempotency.CompleterReport{Found: 1, NeedCredentials: 1}) {
		t.Fatalf("Completer: %+v, want one record found that needs credentials", rep)
	}
	if rec := mustGet(t, s, sc); rec.State != idempotency.InProgress ||
		rec.RecoveryPoint != "order" {
		t.Fatalf("after the refused resume: state %v point %q; want in progress at \"order\"",
			rec.State, rec.RecoveryPoint)
	}
	first := post(g, "resume", "acct-1", `{"amount":4200}`)
	wantStatus(t, "the client's retry", first, http.StatusCreated, true)
	if first.Body.String() != "charged acct-1" || orders != 1 {
		t.Fatalf("the client's retry: %q after %d orders; want \"charged acct-1\" after one",
			first.Body, orders)
	}
	if len(principals) != 2 || principals[0] != "acct-1" || principals[1] != "acct-1" {
		t.Fatalf("Run.Scope.Principal, live then on the client's retry: %q", principals)
	}
	again := post(g, "resume", "acct-1", `{"amount":4200}`)
	wantStatus(t, "a later retry", again, http.StatusCreated, false)
	if again.Body.String() != first.Body.String() || executions != 2 {
		t.Fatalf("a later retry: %q after %d executions", again.Body, executions)
	}
}

var errLostAnswer = errors.New("idempotencytest: the answer was lost with its connection")

// lostAnswer is a store whose first completion applies, then fails as if
// its answer were lost with its connection: Complete, and with lostUnit
// the Commit of a unit.
type lostAnswer struct {
	idempotency.Store
	mu   sync.Mutex
	lost bool
}

// lose reports whether this completion's answer is the one lost.
func (s *lostAnswer) lose() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	first := !s.lost
	s.lost = true
	return first
}

func (s *lostAnswer) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	if err := s.Store.Complete(ctx, l, resp, now); err != nil || !s.lose() {
		return err
	}
	return errLostAnswer
}

// lostAnswerTx is a lostAnswer over a Transactor.
type lostAnswerTx struct {
	*lostAnswer
	tx idempotency.Transactor
}

func (s lostAnswerTx) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit,
	context.Context, error) {
	u, uctx, err := s.tx.Begin(ctx, l)
	if err != nil {
		return nil, uctx, err
	}
	return lostUnit{Unit: u, s: s.lostAnswer}, uctx, nil
}

type lostUnit struct {
	idempotency.Unit
	s *lostAnswer
}

func (u lostUnit) Commit() error {
	if err := u.Unit.Commit(); err != nil || !u.s.lose() {
		return err
	}
	return errLostAnswer
}

// testCompletionAnswerLost: the completion of a request applies, but its
// answer is lost: Complete's, and, when the store is a Transactor, the
// Commit of the request's unit. The completion is fenced: tried again, or
// read back, the record (completed with the execution's owner and
// generation) says it was this one. The client gets its first answer, not
// a replay, the execution ended completed, and a retry gets the replay.
func testCompletionAnswerLost(t *testing.T, s idempotency.Store) {
	tx, isTx := s.(idempotency.Transactor)
	for _, inUnit := range []bool{false, true} {
		if inUnit && !isTx {
			continue
		}
		lost := &lostAnswer{Store: s}
		var store idempotency.Store = lost
		if isTx {
			store = lostAnswerTx{lostAnswer: lost, tx: tx}
		}
		runs := 0
		ex := &executed{}
		g := guarded(idempotency.New(store, idempotency.WithLogger(discard),
			idempotency.WithAnonymousKeys(true), idempotency.WithObserver(ex.observer())),
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				if inUnit {
					run, _ := idempotency.FromContext(r.Context())
					if _, _, err := run.Unit(r.Context()); err != nil {
						t.Errorf("Run.Unit: %v", err)
					}
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte("paid"))
			}))
		key := "lost-answer"
		if inUnit {
			key += "-unit"
		}
		first := post(g, key, "", `{}`)
		wantStatus(t, key+": the first answer", first, http.StatusCreated, true)
		if lost.lose() {
			t.Fatalf("%s: no completion's answer was lost", key)
		}
		ex.only(t, idempotency.OutcomeCompleted)
		again := post(g, key, "", `{}`)
		wantStatus(t, key+": the retry", again, http.StatusCreated, false)
		if again.Body.String() != "paid" || runs != 1 {
			t.Fatalf("%s: the retry: %q after %d runs; want the replay of the one run",
				key, again.Body, runs)
		}
	}
}

// testMiddlewareDurations: every duration option at its longest value, and
// at a value where the replay window plus the lease overflows, means
// (about) forever: a request completes, its duplicate gets the replay, and
// a Reaper run 100 h later deletes nothing, its horizon centuries back.
func testMiddlewareDurations(t *testing.T, s idempotency.Store) {
	limits := []struct {
		name string
		opt  idempotency.Option
	}{
		{"replay window max", idempotency.WithReplayWindow(math.MaxInt64)},
		{"replay window plus lease overflows",
			idempotency.WithReplayWindow(math.MaxInt64 - 10*time.Second)},
		{"lease max", idempotency.WithLease(math.MaxInt64)},
		{"lease plus window overflows", idempotency.WithLease(math.MaxInt64 - 12*time.Hour)},
		{"cleanup horizon max", idempotency.WithCleanupHorizon(math.MaxInt64)},
	}
	for _, tc := range limits {
		mw := idempotency.New(s, idempotency.WithLogger(discard),
			idempotency.WithAnonymousKeys(true),
			tc.opt)
		runs := 0
		g := guarded(mw, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs++
			w.WriteHeader(http.StatusCreated)
		}))
		key := "limit " + tc.name
		wantStatus(t, tc.name+": first", post(g, key, "", `{}`), http.StatusCreated, true)
		wantStatus(t, tc.name+": duplicate", post(g, key, "", `{}`), http.StatusCreated, false)
		now := time.Now()
		rep, err := mw.Reaper().ReapOnce(ctx(t), now.Add(100*time.Hour))
		noErr(t, tc.name+": ReapOnce", err)
		if rep.Deleted != 0 || !rep.Horizon.Before(now.Add(-100*365*24*time.Hour)) {
			t.Fatalf("%s: a Reaper run 100 h later deleted %d records, horizon %v",
				tc.name, rep.Deleted, rep.Horizon)
		}
		mustGet(t, s, idempotency.Scope{Method: http.MethodPost, Route: "POST /payments", Key: key})
		if runs != 1 {
			t.Fatalf("%s: the handler ran %d times", tc.name, runs)
		}
	}
}
