package idempotency_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Names whose every byte the recovery data keeps: valid UTF-8, any
// character, NUL and JSON's escaped ones included.
var keptNames = []string{"order café", "n\x00ul <&> \u2028", "☃"}

// namesScenario runs a handler whose phases and External calls have the
// names of keptNames and of bad, against the guarded handler that g
// returns. A name that is not valid UTF-8 is refused before anything runs
// (PhaseError with ErrMisuse); the others commit, the first execution
// then fails (500, kept for a resume), and the retry finds each of them
// committed: no phase runs again, no call is made twice, and the retry
// completes.
func namesScenario(t *testing.T, g func(h http.Handler) http.Handler) {
	t.Helper()
	var phaseRuns, calls int
	var refused []error
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		run, _ := idempotency.FromContext(ctx)
		if len(refused) == 0 {
			_, err := run.Phase(ctx, "order caf\xe9", func(context.Context) ([]byte, error) {
				phaseRuns++
				return nil, nil
			})
			refused = append(refused, err)
			_, err = run.External(ctx, "charge \xff", func(context.Context, string) ([]byte, error) {
				calls++
				return nil, nil
			}, nil)
			refused = append(refused, err)
		}
		for _, name := range keptNames {
			out, err := run.Phase(ctx, "phase "+name, func(context.Context) ([]byte, error) {
				phaseRuns++
				return []byte("out " + name + "\xff\xfe"), nil
			})
			require.NoError(t, err)
			require.Equal(t, "out "+name+"\xff\xfe", string(out), "outputs are bytes")
			out, err = run.External(ctx, "call "+name, func(context.Context, string) ([]byte, error) {
				calls++
				return []byte("res " + name), nil
			}, func(context.Context, string) ([]byte, bool, error) {
				t.Error("a committed call is looked up")
				return nil, false, nil
			})
			require.NoError(t, err)
			require.Equal(t, "res "+name, string(out))
		}
		if r.Header.Get("X-Retry") == "" {
			w.WriteHeader(http.StatusInternalServerError) // kept for a resume
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	srv := g(h)
	first := sendWith(t, srv, "k-names", "")
	require.Equal(t, http.StatusInternalServerError, first)
	for _, err := range refused {
		var pe *idempotency.PhaseError
		require.ErrorAs(t, err, &pe)
		require.ErrorIs(t, err, idempotency.ErrMisuse)
		require.Equal(t, "use", pe.Step)
	}
	require.Equal(t, len(keptNames), phaseRuns, "the refused phase never ran")
	require.Equal(t, len(keptNames), calls, "the refused call was never made")
	require.Equal(t, http.StatusCreated, sendWith(t, srv, "k-names", "1"))
	require.Equal(t, len(keptNames), phaseRuns, "no committed phase ran again")
	require.Equal(t, len(keptNames), calls, "no committed call was made again")
}

// sendWith sends a guarded POST /payments with key through h; retry sets
// X-Retry.
func sendWith(t *testing.T, h http.Handler, key, retry string) int {
	t.Helper()
	req := newPost(`{}`, key)
	if retry != "" {
		req.Header.Set("X-Retry", retry)
	}
	return record(h, req).Code
}

// Phase and External names are bytes that round-trip through the record, or
// are refused before anything runs.
func TestRecoveryNamesRoundTripOrAreRefused(t *testing.T) {
	namesScenario(t, func(h http.Handler) http.Handler {
		return idempotency.New(memstore.New(), idempotency.WithLogger(quiet),
			idempotency.WithAnonymousKeys(true)).Wrap(h)
	})
}
