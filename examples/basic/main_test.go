package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net/http"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestRun(t *testing.T) {
	var buf bytes.Buffer
	out, err := run(context.Background(), &buf)
	require.NoError(t, err)
	t.Log("\n" + buf.String())

	inv := out["GET /inventory"]
	require.Equal(t, http.StatusOK, inv.status)
	require.Equal(t, []string{"", "", ""}, inv.requests, "retried twice, no key on a GET")

	orders := out["POST /orders"]
	require.Equal(t, http.StatusCreated, orders.status)
	require.Len(t, orders.requests, 2)
	require.Equal(t, orders.requests[0], orders.requests[1], "the retry reused the key")
	_, err = uuid.Parse(orders.requests[0])
	require.NoError(t, err, "an automatic key is a UUID")

	typo := out["GET /typo"]
	require.Equal(t, http.StatusBadRequest, typo.status)
	require.Len(t, typo.requests, 1, "a 400 is not retried")

	require.Contains(t, buf.String(), "retrying")
	require.Contains(t, buf.String(), "after 3 request(s)")
}

func TestHelpPrintsTheUsage(t *testing.T) {
	var buf bytes.Buffer
	require.ErrorIs(t, parseFlags([]string{"-h"}, &buf), flag.ErrHelp)
	require.Contains(t, buf.String(), "Usage: go run ./examples/basic")
	require.Error(t, parseFlags([]string{"extra"}, io.Discard))
	require.NoError(t, parseFlags(nil, io.Discard))
}
