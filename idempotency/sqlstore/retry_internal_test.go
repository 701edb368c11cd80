package sqlstore

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// stateErr is a driver error with a SQLSTATE, as pgx's *pgconn.PgError and
// lib/pq's *pq.Error expose it.
type stateErr string

func (e stateErr) Error() string    { return "ERROR (SQLSTATE " + string(e) + ")" }
func (e stateErr) SQLState() string { return string(e) }

func TestSerializationFailuresAreRecognisedAndRetried(t *testing.T) {
	for code, want := range map[string]bool{"40001": true, "40P01": true, "23505": false, "40002": false, "": false} {
		err := opErr("complete", fmt.Errorf("driver: %w", stateErr(code)))
		require.Equal(t, want, errors.Is(err, ErrSerialization), code)
		var se stateErr
		require.ErrorAs(t, err, &se, "the driver's error stays reachable")
	}
	require.NotErrorIs(t, opErr("get", errors.New("connection refused")), ErrSerialization)

	// A statement that keeps failing runs statementTries times and returns
	// the last failure.
	calls := 0
	_, err := retried(func() (int, error) {
		calls++
		return 0, opErr("claim", stateErr("40001"))
	})
	require.Equal(t, statementTries, calls)
	require.ErrorIs(t, err, ErrSerialization)

	// One that fails once and then succeeds returns the success.
	calls = 0
	n, err := retried(func() (int, error) {
		calls++
		if calls == 1 {
			return 0, opErr("delete_before", stateErr("40P01"))
		}
		return 7, nil
	})
	require.NoError(t, err)
	require.Equal(t, 7, n)
	require.Equal(t, 2, calls)

	// Other errors are never retried.
	calls = 0
	err = retriedErr(func() error {
		calls++
		return opErr("heartbeat", stateErr("23505"))
	})
	require.Equal(t, 1, calls)
	require.Error(t, err)
}
