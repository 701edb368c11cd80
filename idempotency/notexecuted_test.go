package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// provider is another service that charges cards: its first answers are
// definitive refusals that charged nothing (a 503 before any work), then
// it charges.
type provider struct {
	refusals       int
	calls, lookups int
	charged        []string // the downstream keys charged
	lastKey        string
}

func (p *provider) charge(_ context.Context, key string) ([]byte, error) {
	p.calls++
	p.lastKey = key
	if p.refusals > 0 {
		p.refusals--
		return nil, fmt.Errorf("provider answered 503 before charging: %w",
			idempotency.ErrNotExecuted)
	}
	p.charged = append(p.charged, key)
	return []byte("ch_1"), nil
}

func (p *provider) lookup(context.Context, string) ([]byte, bool, error) {
	p.lookups++
	return nil, false, nil
}

// An External call that the other service refused definitively, having
// done nothing (ErrNotExecuted), withdraws its intent: the answer is not
// held back as incomplete (no 503 CodeRequestIncomplete, nothing at
// ERROR), the key is given up, or kept at the phase before (whose resume
// keeps the downstream key), and the next execution calls again without
// asking lookup.
func TestExternalNotExecutedWithdrawsTheIntent(t *testing.T) {
	for _, withPhase := range []bool{false, true} {
		t.Run(fmt.Sprintf("phase before %v", withPhase), func(t *testing.T) {
			mem := memstore.New()
			var logs bytes.Buffer
			p := &provider{refusals: 1}
			orders := 0
			h := idempotency.New(mem, idempotency.WithAnonymousKeys(true),
				idempotency.WithLogger(slog.New(slog.NewTextHandler(&logs,
					&slog.HandlerOptions{Level: slog.LevelDebug})))).
				Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					ctx := r.Context()
					run, _ := idempotency.FromContext(ctx)
					if withPhase {
						_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
							orders++
							return []byte("ord_1"), nil
						})
						require.NoError(t, err)
					}
					ch, err := run.External(ctx, "charge", p.charge, p.lookup)
					if err != nil {
						require.ErrorIs(t, err, idempotency.ErrNotExecuted)
						var pe *idempotency.PhaseError
						require.ErrorAs(t, err, &pe)
						require.Equal(t, "call", pe.Step)
						http.Error(w, "the provider is unavailable", http.StatusServiceUnavailable)
						return
					}
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write(ch)
				}))
			first := send(t, h, "k", `{}`)
			require.Equal(t, http.StatusServiceUnavailable, first.Code)
			require.NotContains(t, first.Body.String(), idempotency.CodeRequestIncomplete,
				"the handler's own answer, not held back")
			require.NotContains(t, logs.String(), "level=ERROR")
			require.Contains(t, logs.String(), "outcome="+map[bool]string{false: "released",
				true: "kept"}[withPhase])
			rec, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
			if withPhase {
				require.NoError(t, err)
				require.Equal(t, "order", rec.RecoveryPoint, "the intent is withdrawn")
			} else {
				require.ErrorIs(t, err, idempotency.ErrNotFound, "the key was given up")
			}
			refusedWith := p.lastKey

			again := send(t, h, "k", `{}`)
			require.Equal(t, http.StatusCreated, again.Code, again.Body.String())
			require.Equal(t, 0, p.lookups, "no lookup after a call that was not executed")
			require.Equal(t, 2, p.calls)
			require.Len(t, p.charged, 1, "charged once")
			if withPhase {
				require.Equal(t, refusedWith, p.charged[0], "a resume keeps the downstream key")
			}
			require.Equal(t, map[bool]int{false: 0, true: 1}[withPhase], orders)
			require.NotContains(t, logs.String(), "level=ERROR")
		})
	}
}

// A call of Do whose function returned while an External call's outcome
// was unknown gets ErrIncomplete (wrapping fn's error); nothing is stored,
// and the next call asks lookup first, then completes.
func TestDoWithAnUnknownExternalOutcomeIsIncomplete(t *testing.T) {
	mem := memstore.New()
	mw := idempotency.New(mem, idempotency.WithLogger(quiet))
	lost := errors.New("timeout waiting for the provider")
	calls, lookups := 0, 0
	fn := func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
		return run.External(ctx, "charge", func(context.Context, string) ([]byte, error) {
			calls++
			if calls == 1 {
				return nil, lost
			}
			return []byte("ch_2"), nil
		}, func(context.Context, string) ([]byte, bool, error) {
			lookups++
			return []byte("ch_1"), true, nil // the first call went through
		})
	}
	c := idempotency.Call{Principal: "p", Operation: "charge", Key: "k"}
	_, err := mw.Do(t.Context(), c, fn)
	require.ErrorIs(t, err, idempotency.ErrIncomplete)
	require.ErrorIs(t, err, lost)
	res, err := mw.Do(t.Context(), c, fn)
	require.NoError(t, err)
	require.Equal(t, idempotency.Result{Output: []byte("ch_1")}, res, "the looked-up outcome")
	require.Equal(t, 1, calls)
	require.Equal(t, 1, lookups)
}

// The function door's writes in the call's unit commit with its output;
// when the unit's commit fails, nothing of it took effect and Do returns
// ErrStoreUnavailable: the next call runs fn again.
func TestDoUnitCommitsWithTheOutput(t *testing.T) {
	mem := memstore.New()
	var ledger []string
	mw := idempotency.New(mem, idempotency.WithLogger(quiet))
	fn := func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
		u, _, err := run.Unit(ctx)
		if err != nil {
			return nil, err
		}
		require.NoError(t, memstore.OnCommit(u, func() { ledger = append(ledger, "entry") }))
		return []byte("posted"), nil
	}
	c := idempotency.Call{Principal: "p", Operation: "post", Key: "k"}
	res, err := mw.Do(t.Context(), c, fn)
	require.NoError(t, err)
	require.Equal(t, []byte("posted"), res.Output)
	require.Equal(t, []string{"entry"}, ledger)

	failing := idempotency.New(failingBegin{memstore.New()}, idempotency.WithLogger(quiet))
	_, err = failing.Do(t.Context(), c, fn)
	require.ErrorIs(t, err, idempotency.ErrStoreUnavailable)
	require.Equal(t, []string{"entry"}, ledger, "nothing of the failed unit took effect")
}
