package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// Each charge takes effect once, hedged or not; with hedging, the stuck
// charges' first attempts get the replay when they reach the middleware
// late, and the hedge of the charge whose handler is slow gets the
// in-progress 409.
func TestRun(t *testing.T) {
	var buf bytes.Buffer
	cfg := config{n: 130, delay: 20 * time.Millisecond, straggle: time.Second}
	results, err := run(context.Background(), &buf, cfg)
	require.NoError(t, err)
	t.Log("\n" + buf.String())
	require.Len(t, results, 2)
	for _, r := range results {
		assert.Equal(t, cfg.n, r.keys, r.name)
		assert.EqualValues(t, cfg.n, r.effects, "%s: one effect per charge", r.name)
		assert.EqualValues(t, 1, r.maxPerKey, r.name)
		assert.Zero(t, r.other, r.name)
	}
	plain, hedged := results[0], results[1]
	assert.EqualValues(t, cfg.n, plain.requests, "no hedging: one request per charge")
	assert.Greater(t, hedged.requests, int64(cfg.n), "hedges were sent")
	assert.GreaterOrEqual(t, hedged.replayed, int64(3), "the 3 stuck first attempts get the replay")
	assert.GreaterOrEqual(t, hedged.busy, int64(1), "the slow handler's hedge gets the in-progress 409")
	assert.Contains(t, buf.String(), " 0 duplicate effects")
}

func TestFlags(t *testing.T) {
	var buf bytes.Buffer
	_, err := parseFlags([]string{"-h"}, &buf)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.Contains(t, buf.String(), "Usage: go run ./examples/hedge")
	for _, args := range [][]string{{"extra"}, {"-n", "0"}, {"-delay", "-1s"}} {
		_, err := parseFlags(args, io.Discard)
		require.Error(t, err, "%q", args)
	}
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, config{n: 200, delay: 20 * time.Millisecond, straggle: 500 * time.Millisecond}, cfg)
}
