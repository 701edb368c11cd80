package bench

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func contender(t *testing.T, name string) Contender {
	t.Helper()
	for _, c := range Contenders {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no contender %q", name)
	return Contender{}
}

// TestPOSTSafetySaferetry checks scenario (d) for saferetry: every failed
// first attempt of a POST is retried once, with one key on both attempts
// (the caller's when it set one) and the full body both times.
func TestPOSTSafetySaferetry(t *testing.T) {
	c := contender(t, "saferetry")
	for _, pc := range POSTCases {
		t.Run(pc.Name, func(t *testing.T) {
			row, err := RunPOSTCase(c, pc)
			require.NoError(t, err)
			require.Equal(t, 2, row.Hits, "keys %q", row.Keys)
			require.True(t, row.KeyOnEvery(), "keys %q", row.Keys)
			require.True(t, row.KeyStable(), "keys %q", row.Keys)
			require.True(t, row.BodyIntact)
			require.Equal(t, "201", row.Result)
			require.Equal(t, "safe retry (same key, same body)", row.Verdict())
			if pc.CallerKey != "" {
				require.Equal(t, pc.CallerKey, row.Keys[0])
			}
		})
	}
}

// TestPOSTSafetyBare checks the harness against the bare transport: one
// attempt, no key unless the caller set one, the failure reaches the caller.
func TestPOSTSafetyBare(t *testing.T) {
	c := contender(t, "bare")
	for _, pc := range POSTCases {
		t.Run(pc.Name, func(t *testing.T) {
			row, err := RunPOSTCase(c, pc)
			require.NoError(t, err)
			require.Equal(t, 1, row.Hits)
			require.Equal(t, pc.CallerKey != "", row.KeyOnEvery())
			require.True(t, row.BodyIntact)
			require.NotEqual(t, "201", row.Result)
			require.Equal(t, "not retried", row.Verdict())
		})
	}
}

// TestPOSTSafetyFailsafeRetriesWithoutKey pins the behaviour the table
// reports for a peer: failsafe-go retries a POST whose connection was reset
// after the server read it, without any key.
func TestPOSTSafetyFailsafeRetriesWithoutKey(t *testing.T) {
	row, err := RunPOSTCase(contender(t, "failsafe"), POSTCases[1])
	require.NoError(t, err)
	require.Equal(t, 2, row.Hits)
	require.False(t, row.KeyOnEvery())
	require.Equal(t, "UNSAFE: POST retried without a key", row.Verdict())
}
