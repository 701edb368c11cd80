package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
	"github.com/saferetry/saferetry/keygen"
)

// processor is a fake card processor: it de-duplicates charges by key and
// counts calls and lookups per key.
type processor struct {
	mu      sync.Mutex
	charges map[string]string
	calls   map[string]int
	lookups map[string]int
}

func newProcessor() *processor {
	return &processor{charges: map[string]string{}, calls: map[string]int{}, lookups: map[string]int{}}
}

func (p *processor) charge(_ context.Context, key string) ([]byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if _, ok := p.charges[key]; !ok {
		p.charges[key] = fmt.Sprintf("ch_%d", len(p.charges)+1)
	}
	return []byte(p.charges[key]), nil
}

func (p *processor) find(_ context.Context, key string) ([]byte, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lookups[key]++
	c, ok := p.charges[key]
	return []byte(c), ok, nil
}

func (p *processor) counts() (calls, lookups map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	calls, lookups = map[string]int{}, map[string]int{}
	for k, v := range p.calls {
		calls[k] = v
	}
	for k, v := range p.lookups {
		lookups[k] = v
	}
	return calls, lookups
}

var errLostAnswer = errors.New("connection reset after the processor answered")

// shop is the worked example: order (a phase whose write commits with it)
// -> charge (External) -> receipt (the request's unit, with the response).
// fail names a point where the current execution fails ("after-order": 502
// after the order phase; "lose-answer": the charge call reaches the
// processor but its answer is lost; "panic-after-order").
type shop struct {
	proc *processor

	mu       sync.Mutex
	fail     map[string]int // point -> how many more executions fail there
	orders   []string       // committed business writes
	receipts []string
	runs     atomic.Int64 // executions of the order phase's function
	errs     []error
}

func newShop() *shop { return &shop{proc: newProcessor(), fail: map[string]int{}} }

func (s *shop) failAt(point string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail[point] > 0 {
		s.fail[point]--
		return true
	}
	return false
}

func (s *shop) onCommit(ctx context.Context, run *idempotency.Run, f func()) {
	u, _, err := run.Unit(ctx)
	if err != nil {
		f() // a plain store: the write is not transactional
		return
	}
	if err := memstore.OnCommit(u, func() { s.mu.Lock(); f(); s.mu.Unlock() }); err != nil {
		panic(err)
	}
}

func (s *shop) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	run, _ := idempotency.FromContext(ctx)
	fail := func(err error) {
		s.mu.Lock()
		s.errs = append(s.errs, err)
		s.mu.Unlock()
		http.Error(w, err.Error(), http.StatusBadGateway)
	}
	order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
		id := fmt.Sprintf("ord_%d", s.runs.Add(1))
		s.onCommit(ctx, run, func() { s.orders = append(s.orders, id) })
		return []byte(id), nil
	})
	if err != nil {
		fail(err)
		return
	}
	if s.failAt("after-order") {
		fail(errors.New("injected failure after the order"))
		return
	}
	if s.failAt("panic-after-order") {
		panic("injected panic after the order")
	}
	charge, err := run.External(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
		out, err := s.proc.charge(ctx, key)
		if err == nil && s.failAt("lose-answer") {
			return nil, errLostAnswer
		}
		return out, err
	}, s.proc.find)
	if err != nil {
		fail(err)
		return
	}
	receipt := fmt.Sprintf("rcpt_%s_%s", order, charge)
	s.onCommit(ctx, run, func() { s.receipts = append(s.receipts, receipt) })
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%q,"charge":%q,"receipt":%q}`, order, charge, receipt)
}

func (s *shop) state() (orders, receipts []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.orders...), append([]string(nil), s.receipts...)
}

func requireReplayed(t *testing.T, rec *httptest.ResponseRecorder, body string) {
	t.Helper()
	require.Equal(t, "true", rec.Header().Get(idempotency.ReplayedHeader), "not a replay: %d %s", rec.Code, rec.Body)
	require.Equal(t, body, rec.Body.String())
}

var payScope = idempotency.Scope{Method: "POST", Route: "/payments", Key: "order-42"}

// A failure after the order phase keeps the record with its recovery point
// and ends the lease at once; the retry resumes: the order is not created
// again, the card is charged once, and the response is stored and replayed.
func TestPhasesResumeAfterAFailure(t *testing.T) {
	for _, point := range []string{"after-order", "panic-after-order"} {
		t.Run(point, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := memstore.New()
				s := newShop()
				s.fail[point] = 1
				h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(s)

				if point == "panic-after-order" {
					require.Panics(t, func() { send(t, h, "order-42", `{"amount":4200}`) })
				} else {
					first := send(t, h, "order-42", `{"amount":4200}`)
					require.Equal(t, http.StatusBadGateway, first.Code)
				}
				rec, err := mem.Get(t.Context(), payScope)
				require.NoError(t, err)
				require.Equal(t, idempotency.InProgress, rec.State)
				require.Equal(t, "order", rec.RecoveryPoint)
				require.False(t, rec.LeaseUntil.After(time.Now()), "the lease ended at once")
				data, err := idempotency.DecodeRecovery(rec.RecoveryData)
				require.NoError(t, err)
				require.Equal(t, idempotency.Recovery{Phases: []idempotency.CommittedPhase{{Name: "order", Output: []byte("ord_1")}}}, data)
				orders, _ := s.state()
				require.Equal(t, []string{"ord_1"}, orders, "the order committed with its phase")

				time.Sleep(time.Millisecond)
				second := send(t, h, "order-42", `{"amount":4200}`)
				require.Equal(t, http.StatusCreated, second.Code, second.Body.String())
				require.JSONEq(t, `{"order":"ord_1","charge":"ch_1","receipt":"rcpt_ord_1_ch_1"}`, second.Body.String())
				require.EqualValues(t, 1, s.runs.Load(), "the order phase did not run again")
				calls, lookups := s.proc.counts()
				require.Len(t, calls, 1)
				for k, n := range calls {
					require.Equal(t, 1, n, "key %s", k)
				}
				require.Empty(t, lookups, "no intent was recorded before the failure: nothing to look up")
				orders, receipts := s.state()
				require.Equal(t, []string{"ord_1"}, orders)
				require.Equal(t, []string{"rcpt_ord_1_ch_1"}, receipts)

				replay := send(t, h, "order-42", `{"amount":4200}`)
				require.Equal(t, "true", replay.Header().Get(idempotency.ReplayedHeader))
				require.Equal(t, second.Body.String(), replay.Body.String())
				rec, err = mem.Get(t.Context(), payScope)
				require.NoError(t, err)
				require.Equal(t, idempotency.Completed, rec.State)
				require.EqualValues(t, 2, rec.Generation)
			})
		})
	}
}

// The charge reached the processor but its answer was lost: the intent is
// recorded, so the retry asks the processor by the downstream key instead
// of charging again. When the call never reached it, the lookup finds
// nothing and the retry calls again with the same key.
func TestExternalIntentIsLookedUpOnResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		s := newShop()
		s.fail["lose-answer"] = 1
		h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(s)

		first := send(t, h, "order-42", `{}`)
		// The shop answered 502; its client gets 503 CodeRequestIncomplete, which
		// a client retries, while the charge's outcome is unknown.
		require.Equal(t, http.StatusServiceUnavailable, first.Code, first.Body.String())
		require.Contains(t, first.Body.String(), idempotency.CodeRequestIncomplete)
		rec, err := mem.Get(t.Context(), payScope)
		require.NoError(t, err)
		require.Equal(t, "intent:charge", rec.RecoveryPoint)
		data, err := idempotency.DecodeRecovery(rec.RecoveryData)
		require.NoError(t, err)
		require.NotNil(t, data.Pending)
		key := data.Pending.DownstreamKey
		require.Equal(t, "charge", data.Pending.Phase)
		require.True(t, strings.HasPrefix(key, "charge-"), key)
		require.NotContains(t, key, "order-42", "the client's key never goes downstream")
		require.NoError(t, keygen.Validate(key))
		var pe *idempotency.PhaseError
		require.ErrorAs(t, s.errs[0], &pe)
		require.Equal(t, "call", pe.Step)
		require.ErrorIs(t, s.errs[0], errLostAnswer)

		time.Sleep(time.Millisecond)
		second := send(t, h, "order-42", `{}`)
		require.Equal(t, http.StatusCreated, second.Code, second.Body.String())
		calls, lookups := s.proc.counts()
		require.Equal(t, map[string]int{key: 1}, calls, "charged once")
		require.Equal(t, map[string]int{key: 1}, lookups, "the retry asked instead")
		rec, err = mem.Get(t.Context(), payScope)
		require.NoError(t, err)
		data, err = idempotency.DecodeRecovery(rec.RecoveryData)
		require.NoError(t, err)
		require.Nil(t, data.Pending)
		require.Equal(t, []idempotency.CommittedPhase{{Name: "order", Output: []byte("ord_1")}, {Name: "charge", Output: []byte("ch_1"), DownstreamKey: key}}, data.Phases)

		// A call that never reached the processor: lookup finds nothing and the
		// call is made again, under the same key.
		mem2 := memstore.New()
		s2 := newShop()
		var attempts atomic.Int64
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			out, err := run.External(r.Context(), "charge", func(ctx context.Context, key string) ([]byte, error) {
				if attempts.Add(1) == 1 {
					return nil, errors.New("dial tcp: connection refused")
				}
				return s2.proc.charge(ctx, key)
			}, s2.proc.find)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			w.WriteHeader(http.StatusCreated)
			w.Write(out)
		})
		h2 := idempotency.New(mem2, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(next)
		require.Equal(t, http.StatusServiceUnavailable, send(t, h2, "k2", `{}`).Code, "the 502 while the outcome is unknown")
		time.Sleep(time.Millisecond)
		a := send(t, h2, "k2", `{}`)
		require.Equal(t, http.StatusCreated, a.Code)
		calls, lookups = s2.proc.counts()
		require.Len(t, calls, 1)
		for k, n := range calls {
			require.Equal(t, 1, n)
			require.Equal(t, 1, lookups[k], "looked up first, under the recorded key")
		}
	})
}

// An owner that comes back after its lease expired and a successor took the
// record over cannot commit a phase (nor its writes), whether it notices
// before starting the phase or only at the phase's commit; an owner whose
// lease expired with no successor renews it and goes on. testing/synctest
// provides the time.
func TestPhaseFencing(t *testing.T) {
	for _, where := range []string{"before the phase", "during the phase"} {
		t.Run(where, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := &partitioned{Store: memstore.New()}
				var (
					calls     atomic.Int64
					committed []string
					mu        sync.Mutex
					aStalled  = make(chan struct{})
					aResume   = make(chan struct{})
					aErr      = make(chan error, 1)
				)
				stall := func() {
					mem.cut.Store(true) // A's heartbeats no longer get through
					close(aStalled)
					<-aResume
				}
				next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					ctx := r.Context()
					run, _ := idempotency.FromContext(ctx)
					who := "B"
					if calls.Add(1) == 1 {
						who = "A"
					}
					if _, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
						return []byte("ord by " + who), nil
					}); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					if who == "A" && where == "before the phase" {
						stall()
					}
					_, err := run.Phase(ctx, "charge", func(ctx context.Context) ([]byte, error) {
						if who == "A" && where == "during the phase" {
							stall()
						}
						u, _, err := run.Unit(ctx)
						require.NoError(t, err)
						require.NoError(t, memstore.OnCommit(u, func() { mu.Lock(); committed = append(committed, who); mu.Unlock() }))
						return []byte("charge by " + who), nil
					})
					if who == "A" {
						aErr <- err
					}
					if err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					w.WriteHeader(http.StatusCreated)
					fmt.Fprint(w, "done by ", who)
				})
				h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second), idempotency.WithLogger(quiet)).Wrap(next)

				aDone := make(chan *httptest.ResponseRecorder)
				go func() { aDone <- send(t, h, "order-42", `{}`) }()
				<-aStalled
				time.Sleep(31 * time.Second) // A's lease is over; no heartbeat got through
				mem.cut.Store(false)
				b := send(t, h, "order-42", `{}`)
				require.Equal(t, http.StatusCreated, b.Code, b.Body.String())
				require.Equal(t, "done by B", b.Body.String())

				close(aResume)
				err := <-aErr
				var pe *idempotency.PhaseError
				require.ErrorAs(t, err, &pe)
				require.ErrorIs(t, err, idempotency.ErrLeaseLost)
				require.Equal(t, "charge", pe.Phase)
				if where == "before the phase" {
					require.Equal(t, "lease", pe.Step, "A renews its expired lease before starting and finds it lost")
				} else {
					require.Equal(t, "commit", pe.Step, "the fence holds at the commit")
				}
				a := <-aDone
				require.Equal(t, http.StatusCreated, a.Code, "A lost its record: its client gets B's stored answer")
				requireReplayed(t, a, "done by B")
				requireReplayed(t, send(t, h, "order-42", `{}`), "done by B")
				require.Equal(t, []string{"B"}, committed, "A's phase writes never committed")
				rec, err := mem.Get(t.Context(), payScope)
				require.NoError(t, err)
				data, err := idempotency.DecodeRecovery(rec.RecoveryData)
				require.NoError(t, err)
				require.Equal(t, []idempotency.CommittedPhase{{Name: "order", Output: []byte("ord by A")}, {Name: "charge", Output: []byte("charge by B")}}, data.Phases,
					"B resumed after A's order")
			})
		})
	}

	t.Run("expired without a successor", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			mem := &hungBeat{Store: memstore.New(), release: make(chan struct{})}
			next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				time.Sleep(time.Minute) // a long pause, but nobody took over
				if _, err := run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return nil, nil }); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				rec, _ := mem.Get(r.Context(), run.Scope)
				fmt.Fprint(w, time.Until(rec.LeaseUntil))
			})
			h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second),
				idempotency.WithLogger(quiet)).Wrap(next)
			a := send(t, h, "k", `{}`)
			close(mem.release)
			require.Equal(t, http.StatusOK, a.Code, a.Body.String())
			require.Equal(t, "30s", a.Body.String(), "the lease was renewed before the phase")
		})
	})
}

// hungBeat is a memstore whose first heartbeat hangs until release, its
// context ignored (a connection that stopped answering): no beat follows
// it, and the lease runs out with nobody to notice but the run itself.
type hungBeat struct {
	*memstore.Store
	once    sync.Once
	release chan struct{}
}

func (h *hungBeat) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	first := false
	h.once.Do(func() { first = true })
	if first {
		<-h.release
		return context.DeadlineExceeded
	}
	return h.Store.Heartbeat(ctx, l, until)
}

// Misuse is a typed error, never a panic, and never commits anything.
func TestPhaseMisuse(t *testing.T) {
	noop := func(context.Context) ([]byte, error) { return []byte("x"), nil }
	cases := map[string]func(ctx context.Context, run *idempotency.Run) error{
		"empty name": func(ctx context.Context, run *idempotency.Run) error {
			_, err := run.Phase(ctx, "", noop)
			return err
		},
		"long name": func(ctx context.Context, run *idempotency.Run) error {
			_, err := run.Phase(ctx, strings.Repeat("p", 129), noop)
			return err
		},
		"nil function": func(ctx context.Context, run *idempotency.Run) error {
			_, err := run.Phase(ctx, "a", nil)
			return err
		},
		"nil call": func(ctx context.Context, run *idempotency.Run) error {
			_, err := run.External(ctx, "a", nil, nil)
			return err
		},
		"repeated name": func(ctx context.Context, run *idempotency.Run) error {
			if _, err := run.Phase(ctx, "a", noop); err != nil {
				return err
			}
			_, err := run.Phase(ctx, "a", noop)
			return err
		},
		"nested": func(ctx context.Context, run *idempotency.Run) error {
			var inner error
			_, err := run.Phase(ctx, "outer", func(ctx context.Context) ([]byte, error) {
				_, inner = run.Phase(ctx, "inner", noop)
				return nil, nil
			})
			return errors.Join(err, inner)
		},
		"after the request's unit": func(ctx context.Context, run *idempotency.Run) error {
			if _, _, err := run.Unit(ctx); err != nil {
				return err
			}
			_, err := run.Phase(ctx, "a", noop)
			return err
		},
		"the request's unit while a phase runs": func(ctx context.Context, run *idempotency.Run) error {
			var inner error
			var pe *idempotency.PhaseError
			_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
				_, _, inner = run.Unit(ctx) // the handler's context, not the phase's
				if errors.As(inner, &pe) && pe.Phase != "order" {
					return nil, fmt.Errorf("PhaseError names phase %q", pe.Phase)
				}
				return nil, nil
			})
			if err != nil {
				return err
			}
			// It opened nothing: the request's unit is still there to begin.
			if _, _, err := run.Unit(ctx); err != nil {
				return fmt.Errorf("the request's unit after the phase: %w", err)
			}
			return inner
		},
		"new phase while an intent is pending": func(ctx context.Context, run *idempotency.Run) error {
			_, err := run.External(ctx, "charge", func(context.Context, string) ([]byte, error) {
				return nil, errors.New("timeout")
			}, nil)
			if err == nil {
				return errors.New("the call should have failed")
			}
			_, err = run.Phase(ctx, "receipt", noop)
			return err
		},
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			var err error
			next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				err = f(r.Context(), run)
			})
			send(t, idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(next), "k", `{}`)
			require.ErrorIs(t, err, idempotency.ErrMisuse)
			var pe *idempotency.PhaseError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, "use", pe.Step)
		})
	}

	t.Run("after the handler returned", func(t *testing.T) {
		var run *idempotency.Run
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { run, _ = idempotency.FromContext(r.Context()) })
		send(t, idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(next), "k", `{}`)
		_, err := run.Phase(t.Context(), "late", noop)
		require.ErrorIs(t, err, idempotency.ErrMisuse)
		_, err = run.External(t.Context(), "late", func(context.Context, string) ([]byte, error) { return nil, nil }, nil)
		require.ErrorIs(t, err, idempotency.ErrMisuse)
	})

	t.Run("unreadable recovery data", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			mem := memstore.New()
			var err error
			calls := 0
			next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				if calls++; calls == 1 {
					// Someone else's recovery point format.
					require.NoError(t, mem.SetRecoveryPoint(r.Context(), run.Lease, "legacy", []byte("order-7"), time.Now()))
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				_, err = run.Phase(r.Context(), "order", noop)
			})
			h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(next)
			send(t, h, "k", `{}`)
			time.Sleep(time.Millisecond)
			send(t, h, "k", `{}`)
			require.ErrorIs(t, err, idempotency.ErrBadRecoveryData)
			var pe *idempotency.PhaseError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, "decode", pe.Step)
		})
	})
}

// A phase whose function fails commits nothing; the error is wrapped with
// the phase's name and reachable with errors.Is.
func TestPhaseFunctionError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		boom := errors.New("insufficient stock")
		var err error
		var committed atomic.Bool
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			_, err = run.Phase(r.Context(), "order", func(ctx context.Context) ([]byte, error) {
				u, _, _ := run.Unit(ctx)
				require.NoError(t, memstore.OnCommit(u, func() { committed.Store(true) }))
				return nil, boom
			})
			http.Error(w, "no", http.StatusConflict)
		})
		send(t, idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(next), "k", `{}`)
		require.ErrorIs(t, err, boom)
		var pe *idempotency.PhaseError
		require.ErrorAs(t, err, &pe)
		require.Equal(t, idempotency.PhaseError{Phase: "order", Step: "run", Err: boom}, *pe)
		require.Equal(t, `idempotency: phase "order": run: insufficient stock`, err.Error())
		require.False(t, committed.Load())
		require.Zero(t, mem.Len(), "nothing committed: the 409 released the key")
	})
}

// With a store that is not a Transactor, phases still record their
// recovery points (their writes are their own), and Unit says why it has
// nothing to give.
func TestPhasesOnAPlainStore(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		s := newShop()
		s.fail["after-order"] = 1
		h := idempotency.New(plainStore{mem}, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(s)
		require.Equal(t, http.StatusBadGateway, send(t, h, "order-42", `{}`).Code)
		rec, err := mem.Get(t.Context(), payScope)
		require.NoError(t, err)
		require.Equal(t, "order", rec.RecoveryPoint)
		time.Sleep(time.Millisecond)
		a := send(t, h, "order-42", `{}`)
		require.Equal(t, http.StatusCreated, a.Code)
		require.EqualValues(t, 1, s.runs.Load())
		calls, _ := s.proc.counts()
		require.Len(t, calls, 1)
	})
}

// Downstream keys are stable across executions of one request, differ
// between principals that reuse a key, and are valid keys.
func TestDownstreamKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var mu sync.Mutex
		keys := map[string][]string{} // principal -> keys seen
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			mu.Lock()
			keys[run.Scope.Principal] = append(keys[run.Scope.Principal], run.DownstreamKey("charge"))
			mu.Unlock()
			w.WriteHeader(http.StatusServiceUnavailable)
			// keep the record for a takeover
			_ = mem.SetRecoveryPoint(r.Context(), run.Lease, "x", nil, time.Now())
		})
		h := idempotency.New(mem, idempotency.WithLogger(quiet), idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil
		})).Wrap(next)
		for _, acct := range []string{"a", "a", "b"} {
			req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", `"k,1"`)
			req.Header.Set("X-Account", acct)
			h.ServeHTTP(httptest.NewRecorder(), req)
			time.Sleep(time.Millisecond)
		}
		require.Len(t, keys["a"], 2)
		require.Equal(t, keys["a"][0], keys["a"][1], "the takeover derives the same key")
		require.NotEqual(t, keys["a"][0], keys["b"][0], "another principal's request gets another key")
		for _, k := range []string{keys["a"][0], keys["b"][0]} {
			require.NoError(t, keygen.Validate(k))
			require.True(t, strings.HasPrefix(k, "charge-"), k)
			require.NotContains(t, k, "k%2C1", "the client's key never goes downstream")
			require.NotContains(t, k, "k,1")
		}

		// The key is the scope's: a Run of the same scope derives it too.
		r1 := &idempotency.Run{Scope: idempotency.Scope{Principal: "a", Method: "POST", Route: "/p", Key: "k"}}
		r2 := &idempotency.Run{Scope: idempotency.Scope{Principal: "b", Method: "POST", Route: "/p", Key: "k"}}
		require.NotEqual(t, r1.DownstreamKey("x"), r2.DownstreamKey("x"))
		require.Equal(t, r1.DownstreamKey("x"), (&idempotency.Run{Scope: r1.Scope}).DownstreamKey("x"))

		// A handler that failed after a downstream call gives the key up:
		// the client's retry is a new execution, and it calls downstream
		// with the same key, so that the other service de-duplicates.
		mem2 := memstore.New()
		var seen []string
		h2 := idempotency.New(mem2, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			seen = append(seen, run.DownstreamKey("charge"))
			if len(seen) == 1 {
				w.WriteHeader(http.StatusServiceUnavailable) // released: the retry runs again
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
		require.Equal(t, http.StatusServiceUnavailable, send(t, h2, "k", `{}`).Code)
		_, err := mem2.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
		require.ErrorIs(t, err, idempotency.ErrNotFound, "the 503 gave the key up")
		require.Equal(t, http.StatusCreated, send(t, h2, "k", `{}`).Code)
		require.Len(t, seen, 2)
		require.Equal(t, seen[0], seen[1], "the retry after a release derives the same key")
	})
}

func TestRecoveryEncoding(t *testing.T) {
	rec := idempotency.Recovery{
		Phases:  []idempotency.CommittedPhase{{Name: "order", Output: []byte(`{"id":1}`)}, {Name: "charge", Output: []byte("ch_1"), DownstreamKey: "k-charge-1"}},
		Pending: &idempotency.PendingCall{Phase: "refund", DownstreamKey: "k-refund-1"},
	}
	b := rec.Encode()
	var raw map[string]any
	require.NoError(t, json.Unmarshal(b, &raw))
	require.EqualValues(t, 1, raw["v"])
	got, err := idempotency.DecodeRecovery(b)
	require.NoError(t, err)
	require.Equal(t, rec, got)

	empty, err := idempotency.DecodeRecovery(nil)
	require.NoError(t, err)
	require.Equal(t, idempotency.Recovery{}, empty)

	for name, in := range map[string]string{
		"not json":          `order-7`,
		"other version":     `{"v":2}`,
		"no version":        `{"phases":[]}`,
		"empty name":        `{"v":1,"phases":[{"name":""}]}`,
		"repeated name":     `{"v":1,"phases":[{"name":"a"},{"name":"a"}]}`,
		"pending committed": `{"v":1,"phases":[{"name":"a"}],"pending":{"phase":"a","downstream_key":"k"}}`,
		"pending no name":   `{"v":1,"pending":{"phase":""}}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := idempotency.DecodeRecovery([]byte(in))
			require.ErrorIs(t, err, idempotency.ErrBadRecoveryData)
		})
	}
}

func FuzzDecodeRecovery(f *testing.F) {
	f.Add([]byte(`{"v":1,"phases":[{"name":"order","output":"b3JkXzE="}],"pending":{"phase":"charge","downstream_key":"k"}}`))
	f.Add([]byte(`{"v":1}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, err := idempotency.DecodeRecovery(b)
		if err != nil {
			if !errors.Is(err, idempotency.ErrBadRecoveryData) {
				t.Fatalf("error %v does not match ErrBadRecoveryData", err)
			}
			return
		}
		again, err := idempotency.DecodeRecovery(rec.Encode())
		if err != nil {
			t.Fatalf("re-encoding a decoded record fails: %v", err)
		}
		if len(again.Phases) != len(rec.Phases) || (again.Pending == nil) != (rec.Pending == nil) {
			t.Fatalf("round trip changed %+v to %+v", rec, again)
		}
	})
}

// An answer given while an External call's outcome is unknown is never
// stored and never sent: whether its status is storable (a 402 after a charge
// call that timed out, or even a 201) or not (409, 429, 500, 502, which the
// Transport would not retry or would retry as a fresh failure), the client
// gets 503 CodeRequestIncomplete, the record is kept with the
// intent and its lease ended, the failure is logged at Error, and the retry
// resumes with lookup and finds the charge that did go through.
func TestNoResponseStoredWhileAnExternalOutcomeIsUnknown(t *testing.T) {
	for _, status := range []int{http.StatusPaymentRequired, http.StatusCreated,
		http.StatusConflict, http.StatusTooManyRequests, http.StatusInternalServerError, http.StatusBadGateway} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := memstore.New()
				proc := newProcessor()
				var timeouts atomic.Int64
				timeouts.Store(1)
				next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					run, _ := idempotency.FromContext(r.Context())
					out, err := run.External(r.Context(), "charge", func(ctx context.Context, key string) ([]byte, error) {
						out, err := proc.charge(ctx, key) // it goes through...
						if timeouts.Add(-1) >= 0 {
							return nil, context.DeadlineExceeded // ...but the answer times out
						}
						return out, err
					}, proc.find)
					if err != nil {
						w.WriteHeader(status) // "payment required": a storable status
						return
					}
					w.WriteHeader(http.StatusCreated)
					w.Write(out)
				})
				log, buf := bufLogger()
				h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(log)).Wrap(next)

				first := send(t, h, "order-42", `{}`)
				require.Equal(t, http.StatusServiceUnavailable, first.Code, first.Body.String())
				require.Contains(t, first.Body.String(), idempotency.CodeRequestIncomplete)
				rec, err := mem.Get(t.Context(), payScope)
				require.NoError(t, err)
				require.Equal(t, idempotency.InProgress, rec.State, "not stored")
				require.Equal(t, "intent:charge", rec.RecoveryPoint)
				require.False(t, rec.LeaseUntil.After(time.Now()), "the lease ended at once")
				require.Contains(t, buf.String(), "level=ERROR")
				require.Contains(t, buf.String(), "unknown")

				time.Sleep(time.Millisecond)
				second := send(t, h, "order-42", `{}`)
				require.Equal(t, http.StatusCreated, second.Code, second.Body.String())
				require.Equal(t, "ch_1", second.Body.String())
				calls, lookups := proc.counts()
				require.Len(t, calls, 1)
				for k, n := range calls {
					require.Equal(t, 1, n, "charged once")
					require.Equal(t, 1, lookups[k], "the resume asked first")
				}
				requireReplayed(t, send(t, h, "order-42", `{}`), "ch_1")
			})
		})
	}
}
