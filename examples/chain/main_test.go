package main

import (
	"bytes"
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// quick is the default configuration with 1 ms backoff bases, so that the
// nested retries of the run without pushback wait milliseconds.
func quick() config {
	return config{requests: 10, concurrency: 10, fail: 1, base: time.Millisecond, seed: 1}
}

// The demo's figures, over three real loopback servers: 27 requests at the
// bottom per user request without pushback, 3 with it.
func TestPushbackKeepsTheBottomAtThreePerUserRequest(t *testing.T) {
	var out bytes.Buffer
	ok, err := run(context.Background(), quick(), &out)
	require.NoError(t, err)
	assert.True(t, ok)
	t.Log("\n" + out.String())
	s := out.String()
	assert.Regexp(t, `bottom requests per user request\s+27\.00\s+3\.00`, s)
	assert.Regexp(t, `front received\s+30\s+10 \(0 retries\)`, s)
	assert.Regexp(t, `middle received\s+90\s+10 \(0 retries\)`, s)
	assert.Regexp(t, `bottom received\s+270\s+30 \(20 retries\)`, s)
}

// With the default budgets, the buckets drain and the chain settles at one
// request at the bottom per user request; with pushback it never sends
// more than 3.
func TestBudgetsSettleAtOne(t *testing.T) {
	cfg := quick()
	cfg.budgets, cfg.requests, cfg.concurrency = true, 40, 1
	rs := make([]result, 0, 2)
	for _, pushback := range []bool{false, true} {
		r, err := runChain(context.Background(), cfg, pushback)
		require.NoError(t, err)
		rs = append(rs, r)
		for i, n := range r.perUser[30:] {
			assert.Equal(t, int64(1), n, "pushback %v, user request %d", pushback, 31+i)
		}
	}
	assert.Equal(t, int64(27), rs[0].perUser[0], "full buckets: every layer retries")
	for i, n := range rs[1].perUser {
		assert.LessOrEqual(t, n, int64(3), "user request %d", i+1)
	}
}

// At 50%, with pushback, about 1 - 0.5^3 of the user requests succeed.
func TestHalfOutage(t *testing.T) {
	cfg := quick()
	cfg.fail, cfg.requests, cfg.concurrency = 0.5, 200, 1 // one at a time: the coins fall in one order
	r, err := runChain(context.Background(), cfg, true)
	require.NoError(t, err)
	assert.InDelta(t, 0.875, float64(r.succeeded)/200, 0.07)
	assert.LessOrEqual(t, slices.Max(r.perUser), int64(3))
}

func TestCommandLine(t *testing.T) {
	for _, arg := range []string{"-h", "-help"} {
		var stderr bytes.Buffer
		assert.Equal(t, 0, realMain([]string{arg}, io.Discard, &stderr), arg)
		assert.True(t, strings.HasPrefix(stderr.String(), "Usage: go run ./examples/chain"), arg)
		assert.Contains(t, stderr.String(), "-budgets")
	}
	for _, args := range [][]string{{"-nope"}, {"extra"}, {"-requests", "0"}, {"-concurrency", "0"},
		{"-fail", "1.5"}, {"-fail", "NaN"}, {"-base", "0s"}} {
		assert.Equal(t, 2, realMain(args, io.Discard, io.Discard), "%q", args)
	}
}
