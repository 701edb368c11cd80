package idempotency_test

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// A store that cannot claim in a transaction runs WithOneTransaction's
// requests through the multi-step lifecycle, says so at Warn once, and
// refuses phases in a fresh execution as the option does on every store.
func TestOneTransactionFallsBack(t *testing.T) {
	var logs bytes.Buffer
	mw := idempotency.New(memstore.New(), idempotency.WithOneTransaction(true),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.Contains(t, logs.String(), "level=WARN")
	require.Contains(t, logs.String(), "not a ClaimTransactor")

	call := idempotency.Call{Principal: "p", Operation: "op", Key: "k"}
	res, err := mw.Do(t.Context(), call, func(ctx context.Context, run *idempotency.Run) (
		[]byte, error) {
		_, perr := run.Phase(ctx, "charge", func(context.Context) ([]byte, error) {
			return nil, nil
		})
		require.ErrorIs(t, perr, idempotency.ErrOneTransaction)
		var pe *idempotency.PhaseError
		require.ErrorAs(t, perr, &pe)
		require.Equal(t, "use", pe.Step)
		return []byte("out"), nil
	})
	require.NoError(t, err)
	require.Equal(t, "out", string(res.Output))
	_, err = mw.Do(t.Context(), call, nil)
	require.ErrorIs(t, err, idempotency.ErrInvalidCall) // a nil fn is refused before the claim
	res, err = mw.Do(t.Context(), call, func(context.Context, *idempotency.Run) ([]byte, error) {
		t.Fatal("replayed calls do not run")
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.Result{Output: []byte("out"), Replayed: true}, res)

	var quiet bytes.Buffer
	idempotency.New(memstore.New(), idempotency.WithOneTransaction(false),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(&quiet, nil))))
	require.Empty(t, quiet.String())
}
