package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestRun(t *testing.T) {
	var buf bytes.Buffer
	rep, err := run(context.Background(), &buf)
	require.NoError(t, err)
	t.Log("\n" + buf.String())

	require.Equal(t, []string{"order-confirm-42", "order-confirm-42"}, rep.eventKey, "both processes derived the same key")
	require.Equal(t, int64(1), rep.eventEmails, "the restart replayed instead of sending again")
	require.True(t, rep.eventReplayed)
	require.True(t, rep.sameConfirmation, "the replay is the first answer, verbatim")

	require.Len(t, rep.randomKeys, 2)
	require.NotEqual(t, rep.randomKeys[0], rep.randomKeys[1], "each process made up its own key")
	require.Equal(t, int64(2), rep.randomEmails, "a forgotten key makes a duplicate")

	require.True(t, rep.collisionSafe)
	require.Contains(t, buf.String(), "e-mails sent for order 42: 1")
}

func TestHelpPrintsTheUsage(t *testing.T) {
	var buf bytes.Buffer
	require.ErrorIs(t, parseFlags([]string{"-h"}, &buf), flag.ErrHelp)
	require.Contains(t, buf.String(), "Usage: go run ./examples/eventkeys")
	require.Error(t, parseFlags([]string{"extra"}, io.Discard))
	require.NoError(t, parseFlags(nil, io.Discard))
}
