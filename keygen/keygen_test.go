package keygen

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// decodeEvent inverts Event for a key made of n parts that was not
// shortened: it splits at the last n-1 '-' and unescapes each part. It is
// the constructive proof of the injectivity that Event documents.
func decodeEvent(s string, n int) ([]string, error) {
	if n == 0 {
		if s != "" {
			return nil, errors.New("non-empty key for zero parts")
		}
		return nil, nil
	}
	escaped := make([]string, n)
	for i := n - 1; i > 0; i-- {
		j := strings.LastIndexByte(s, '-')
		if j < 0 {
			return nil, fmt.Errorf("missing separator for part %d", i)
		}
		escaped[i], s = s[j+1:], s[:j]
	}
	escaped[0] = s
	parts := make([]string, n)
	for i, e := range escaped {
		var b strings.Builder
		for k := 0; k < len(e); k++ {
			if e[k] != '%' {
				b.WriteByte(e[k])
				continue
			}
			if k+2 >= len(e) {
				return nil, fmt.Errorf("truncated escape in part %d", i)
			}
			v, err := strconv.ParseUint(e[k+1:k+3], 16, 8)
			if err != nil {
				return nil, fmt.Errorf("bad escape in part %d: %w", i, err)
			}
			b.WriteByte(byte(v))
			k += 2
		}
		parts[i] = b.String()
	}
	return parts, nil
}

func TestEventExamples(t *testing.T) {
	cases := []struct {
		parts []string
		want  string
	}{
		{[]string{"order-confirm", "42"}, "order-confirm-42"},
		{[]string{"a-b", "c"}, "a-b-c"},
		{[]string{"a", "b-c"}, "a-b%2Dc"},
		{[]string{"refund", "ord 7", "50%"}, "refund-ord%207-50%25"},
		{[]string{"caf\u00e9", "x\ny"}, "caf%C3%A9-x%0Ay"},
		{[]string{"e%v", "\x7f"}, "e%25v-%7F"},
		{[]string{"only"}, "only"},
		{[]string{"", ""}, "-"},
		{[]string{"", "x"}, "-x"},
		{[]string{"ev", "", ""}, "ev--"},
		{nil, ""},
		{[]string{""}, ""},
	}
	for _, c := range cases {
		got := Event(c.parts...)
		require.Equal(t, c.want, got, "Event(%q)", c.parts)
		require.Equal(t, got, Event(c.parts...), "Event must be deterministic")
		if got != "" {
			require.NoError(t, Validate(got))
			back, err := decodeEvent(got, len(c.parts))
			require.NoError(t, err)
			require.Equal(t, c.parts, back)
		} else {
			require.ErrorIs(t, Validate(got), ErrInvalidKey)
		}
	}
	require.NotEqual(t, Event("a-b", "c"), Event("a", "b-c"))
}

func TestEventDocumentedCollision(t *testing.T) {
	// Different arities can coincide when an event name is a '-'-joined
	// prefix of another: the documented limitation.
	require.Equal(t, Event("order-confirm", "42"), Event("order", "confirm", "42"))
	// With the arity fixed, the same inputs stay apart.
	require.NotEqual(t, Event("order", "confirm-42"), Event("order-confirm", "42"))
}

func TestEventLong(t *testing.T) {
	long := strings.Repeat("x", 300)
	k1 := Event("ev", long)
	require.LessOrEqual(t, len(k1), maxLen)
	require.NoError(t, Validate(k1))
	require.Equal(t, k1, Event("ev", long))
	require.True(t, strings.HasPrefix(k1, "ev-xxxx"))
	require.Contains(t, k1, hashMarker)
	require.NotEqual(t, k1, Event("ev", long+"y"), "the hash covers the tail")
	require.NotEqual(t, k1, Event("ev", strings.Repeat("x", 299)))

	// Exactly maxLen is kept as is; one more byte is shortened.
	exact := Event(strings.Repeat("a", maxLen))
	require.Equal(t, strings.Repeat("a", maxLen), exact)
	over := Event(strings.Repeat("a", maxLen+1))
	require.Len(t, over, hashedPrefixLen+len(hashMarker)+64)

	// The prefix never ends inside an escape, at any alignment.
	for shift := 0; shift < 3; shift++ {
		k := Event(strings.Repeat("a", shift), strings.Repeat("-", 200))
		i := strings.Index(k, hashMarker)
		require.Positive(t, i)
		prefix := k[:i]
		require.NotEqual(t, byte('%'), prefix[len(prefix)-1])
		require.NotEqual(t, byte('%'), prefix[len(prefix)-2])
		require.NoError(t, Validate(k))
		require.LessOrEqual(t, len(k), maxLen)
	}
}

const helperEnv = "KEYGEN_TEST_PRINT_EVENTS"

var crossProcessInputs = [][]string{
	{"order-confirm", "42"},
	{"refund", "ord 7", "50%"},
	{"caf\u00e9", strings.Repeat("long-", 80)},
}

func printEvents() string {
	var b strings.Builder
	for _, p := range crossProcessInputs {
		b.WriteString(Event(p...))
		b.WriteByte('\n')
	}
	return b.String()
}

// TestMain prints the keys instead of running the tests when the
// cross-process test runs this binary again with helperEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		fmt.Print(printEvents())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestEventAcrossProcesses(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	out, err := cmd.Output()
	require.NoError(t, err)
	require.Equal(t, printEvents(), string(out))
	require.Contains(t, string(out), "order-confirm-42\n")
}

func TestRandom(t *testing.T) {
	seen := make(map[string]bool, 1000)
	for range 1000 {
		k := Random()
		require.NoError(t, Validate(k))
		require.Len(t, k, 36)
		u, err := uuid.Parse(k)
		require.NoError(t, err)
		require.Equal(t, uuid.Version(4), u.Version())
		require.Equal(t, uuid.RFC4122, u.Variant())
		require.Equal(t, u.String(), k, "canonical lower-case form")
		require.False(t, seen[k], "duplicate key %s", k)
		seen[k] = true
	}
}

func TestContext(t *testing.T) {
	ctx := context.Background()
	_, ok := FromContext(ctx)
	require.False(t, ok)

	//lint:ignore SA1012 a nil context is the input under test
	k, ok := FromContext(nil)
	require.False(t, ok)
	require.Empty(t, k)

	ctx2 := NewContext(ctx, "abc")
	k, ok = FromContext(ctx2)
	require.True(t, ok)
	require.Equal(t, "abc", k)

	_, ok = FromContext(NewContext(ctx, ""))
	require.False(t, ok, "an empty key counts as absent")

	//lint:ignore SA1012 a nil context is the input under test
	k, ok = FromContext(NewContext(nil, "def"))
	require.True(t, ok)
	require.Equal(t, "def", k)
}
