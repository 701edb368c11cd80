package sqlstore_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// On SQLite and PostgreSQL, phase and External names are bytes that
// round-trip through the record, or are refused before anything runs: a
// name that is not valid UTF-8 gets a PhaseError with ErrMisuse and its
// function never runs; the others (any character, NUL and JSON's escaped
// ones included) commit, with outputs of any bytes, and the retry after a
// failure finds each committed, so no phase runs again and no call is
// made twice.
func TestRecoveryNamesAreBytesSQL(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		names := []string{"order café", "n\x00ul <&> \u2028", "☃"}
		var executions, phaseRuns, calls int
		var refused []error
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			run, _ := idempotency.FromContext(ctx)
			executions++
			if executions == 1 {
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
			for _, name := range names {
				out, err := run.Phase(ctx, "phase "+name, func(context.Context) ([]byte, error) {
					phaseRuns++
					return []byte("out " + name + "\xff\xfe"), nil
				})
				require.NoError(t, err)
				require.Equal(t, "out "+name+"\xff\xfe", string(out), "outputs are bytes")
				out, err = run.External(ctx, "call "+name, func(context.Context, string) ([]byte, error) {
					calls++
					return []byte("res " + name), nil
				}, nil)
				require.NoError(t, err)
				require.Equal(t, "res "+name, string(out))
			}
			if executions == 1 {
				w.WriteHeader(http.StatusInternalServerError) // kept for a resume
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		srv := httptest.NewServer(idempotency.New(s, idempotency.WithAnonymousKeys(true),
			idempotency.WithLogger(slog.New(slog.DiscardHandler))).Wrap(h))
		t.Cleanup(srv.Close)

		require.Equal(t, http.StatusInternalServerError, post(t, srv, "", "k-names", "pay").status)
		require.Len(t, refused, 2)
		for _, err := range refused {
			var pe *idempotency.PhaseError
			require.ErrorAs(t, err, &pe)
			require.ErrorIs(t, err, idempotency.ErrMisuse)
			require.Equal(t, "use", pe.Step)
		}
		require.Equal(t, len(names), phaseRuns, "the refused phase never ran")
		require.Equal(t, len(names), calls, "the refused call was never made")
		again := post(t, srv, "", "k-names", "pay")
		require.Equal(t, http.StatusCreated, again.status, again.body)
		require.Equal(t, len(names), phaseRuns, "no committed phase ran again")
		require.Equal(t, len(names), calls, "no committed call was made again")
	})
}
