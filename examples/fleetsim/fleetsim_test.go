package main

import (
	"bytes"
	"encoding/csv"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/saferetry/saferetry/budget"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Brooker's orderings at 100 clients, for two seeds: full jitter makes the
// fewest write calls, and at most half of exponential's without jitter,
// which takes the longest; decorrelated jitter finishes before full. Each
// level is the mean of 40 runs, which holds every ordering for each seed
// from 1 to 60 (at 10 runs the gap of about 8% between decorrelated and
// full is within the noise of some seeds).
func TestContentionOrderingsAt100Clients(t *testing.T) {
	for _, seed := range []uint64{1, 2} {
		c := DefaultOCCConfig(seed)
		c.Clients = []int{100}
		c.Runs = 40
		r := RunOCC(c)[0]
		require.Equal(t, 100, r.Clients)
		for s, st := range Strategies {
			if s != stratFull {
				assert.Greater(t, r.Calls[s], r.Calls[stratFull], "seed %d: full jitter must make fewer calls than %s", seed, st.Name)
			}
			if s != stratExpo {
				assert.Less(t, r.Time[s], r.Time[stratExpo], "seed %d: exponential without jitter must take longer than %s", seed, st.Name)
			}
		}
		assert.GreaterOrEqual(t, r.Calls[stratExpo], 2*r.Calls[stratFull], "seed %d: exponential without jitter vs full jitter calls", seed)
		assert.Less(t, r.Time[stratDecorr], r.Time[stratFull], "seed %d: decorrelated must finish sooner than full", seed)
		for _, ch := range CheckOCC(r) {
			assert.True(t, ch.OK, "seed %d: %s", seed, ch.Claim)
		}
	}
}

// Every client writes once successfully, so the server sees at least n write
// calls and the row ends at version n; one client alone succeeds at once,
// after four network delays (read, reply, write, reply).
func TestSimulateOCCInvariants(t *testing.T) {
	c := DefaultOCCConfig(7)
	rng := rand.New(rand.NewPCG(1, 2))
	calls, end := simulateOCC(1, Strategies[stratFull].Func, c, rng)
	assert.Equal(t, 1, calls)
	assert.Greater(t, end, 20*time.Millisecond)
	assert.Less(t, end, 80*time.Millisecond)

	for _, st := range Strategies {
		calls, end := simulateOCC(50, st.Func, c, rng)
		assert.GreaterOrEqual(t, calls, 50, st.Name)
		assert.Greater(t, end, 40*time.Millisecond, st.Name)
	}
	// Without backoff, every round lets exactly one client through at most,
	// so the calls are at least 1+2+...+n minus overlaps: far more than n.
	calls, _ = simulateOCC(50, nil, c, rng)
	assert.Greater(t, calls, 50*5)
}

// Results depend on the seed only, not on how many workers run them.
func TestContentionDeterministic(t *testing.T) {
	c := DefaultOCCConfig(3)
	c.Clients = []int{10, 40}
	c.Runs = 5
	c.Workers = 1
	one := RunOCC(c)
	c.Workers = 4
	four := RunOCC(c)
	assert.Equal(t, one, four)
	c.Seed = 4
	assert.NotEqual(t, one, RunOCC(c))
}

// The outage experiment with the parameters docs/BENCHMARKS.md shows: the same
// arrivals for every policy; without a budget every request of the outage is
// sent 3 times; the token bucket lets 35 retries per client through, then
// only what time refills; the ratio budget stays within its guarantee;
// outside the outage the server sees the logical load.
func TestOutageAmplification(t *testing.T) {
	c := DefaultOutageConfig(1)
	rs := RunOutage(c)
	require.Len(t, rs, len(Policies))
	none, bucket, ratio := rs[0], rs[1], rs[2]
	for _, r := range rs {
		assert.Equal(t, none.Requests, r.Requests, "same arrivals for every policy")
		assert.InDelta(t, c.RatePerClient*float64(c.Clients)*c.Duration.Seconds(), float64(r.Requests), 1000)
		// Requests that met the outage on their first attempt: a third of them.
		assert.InDelta(t, float64(r.Requests)/3, float64(r.OutageRequests), 600, r.Policy)
	}
	// Without a budget, every request of the outage is sent 3 times.
	assert.InDelta(t, 3.0, none.OutageAmplification(), 0.01)
	// The token bucket allows 35 transient retries per client, then what
	// time refills: 500 tokens a minute over the outage and the second its
	// last retries take, at 14 tokens a retry.
	outage := (c.OutageEnd - c.OutageStart).Seconds()
	tokens := 500 + 500.0/60*(outage+1)
	assert.LessOrEqual(t, bucket.OutageAmplification(), 1+float64(c.Clients)*tokens/14/float64(bucket.OutageRequests))
	assert.LessOrEqual(t, bucket.OutageAmplification(), 1.1)
	assert.LessOrEqual(t, bucket.Amplification(), 1.05)
	// The ratio budget (budget.Ratio's guarantee): per client, retries in
	// [a, b] <= 20% of the requests in (a-10s, b] + a burst of 10 + 10/s,
	// with [a, b] the outage plus a second for the last retries: 1.51.
	perClient := c.RatePerClient * outage
	bound := 1 + (0.2*c.RatePerClient*(outage+1+10)+10+10*(outage+1))/perClient
	assert.LessOrEqual(t, ratio.OutageAmplification(), bound)
	assert.Greater(t, ratio.OutageAmplification(), 1.2)
	assert.Less(t, ratio.OutageAmplification(), none.OutageAmplification())
	// Before and after the outage, nothing fails and nothing is retried:
	// the server sees the logical load, give or take the requests that a
	// network delay carries over a second's boundary.
	for _, r := range rs {
		for _, s := range []int{2, 5, 8, 35, 45, 55} {
			assert.InDelta(t, r.Logical[s], r.PerSecond[s], 15, "%s, second %d", r.Policy, s)
		}
	}
	// Once the outage is under way: without a budget the server sees 3x the
	// load; the drained bucket (no success refills it) lets through only
	// what time refills, at most one retry per client a second (fewer than
	// 14 tokens left, 8.3 more a second, 14 a retry).
	for s := int(c.OutageStart/time.Second) + 2; s < int(c.OutageEnd/time.Second); s++ {
		assert.InDelta(t, 3*none.Logical[s], none.PerSecond[s], 150, "no budget, second %d", s)
		assert.LessOrEqual(t, bucket.PerSecond[s]-bucket.Logical[s], 15+c.Clients, "token bucket, second %d", s)
		assert.GreaterOrEqual(t, bucket.PerSecond[s]-bucket.Logical[s], -15, "token bucket, second %d", s)
	}
	assert.Greater(t, none.PeakDuringOutage(c), 2*c.Clients*int(c.RatePerClient))
}

// The chain experiment with the parameters docs/CHAIN.md shows, a 3-tier chain
// with 3 attempts per layer: at full outage of the bottom, 27 requests there
// per user request without pushback and 3 with it (as one layer), and once
// the budgets drain 1.0 plus what time refills them; at 50%, with pushback,
// the success rate of one layer of 3 attempts.
func TestChainAmplification(t *testing.T) {
	c := DefaultChainConfig(1)
	rs := RunChain(c)
	require.Len(t, rs, len(ChainVariants))
	one := RunOneLayer(c)
	sum := func(r ChainResult) ChainSummary { return c.Summary(r) }
	naive, pushback, budgets, both := sum(rs[0]), sum(rs[1]), sum(rs[2]), sum(rs[3])
	oneNone, oneBudget := sum(one[0]), sum(one[1])
	for _, r := range append(rs, one...) {
		assert.Equal(t, rs[0].Users, r.Users, "same arrivals for every variant")
		assert.InDelta(t, c.RatePerClient*float64(c.Clients)*c.Duration.Seconds(), float64(sumAll(r.Users)), 500)
		// Healthy: one request at the bottom per user request.
		assert.InDelta(t, 1.0, r.Over(0, c.FullStart-time.Second), 1e-9, r.Variant)
	}
	// Without budgets: 27 without pushback, 3 with it, as one layer.
	assert.InDelta(t, 27.0, naive.Peak, 1e-9)
	assert.InDelta(t, 27.0, naive.FullSteady, 1e-9)
	assert.LessOrEqual(t, pushback.Peak, 3.0)
	assert.InDelta(t, 3.0, pushback.FullSteady, 1e-9)
	assert.InDelta(t, 3.0, oneNone.FullSteady, 1e-9)
	// With the default budgets: at most 3 at the peak with pushback, and
	// in the steady state 1.0 plus what time refills each instance's bucket
	// (fewer than 14 tokens left, 500 a minute over the window and the
	// second its retries take, 14 a retry).
	assert.LessOrEqual(t, both.Peak, 3.0)
	instances := float64(c.Clients + c.Middle*c.Instances)
	users := c.RatePerClient * float64(c.Clients) * c.Steady.Seconds()
	refilled := 1 + instances*(14+500.0/60*(c.Steady.Seconds()+1))/14/users
	for _, r := range []ChainSummary{both, budgets} {
		assert.GreaterOrEqual(t, r.FullSteady, 1.0)
		assert.LessOrEqual(t, r.FullSteady, refilled)
	}
	assert.Less(t, both.FullSteady, budgets.FullSteady, "pushback: only the layer above the bottom retries")
	assert.Less(t, budgets.Peak, naive.Peak/5)
	// At 50%: with pushback, the success rate of one layer of 3 attempts
	// (1 - 0.5^3 = 87.5% without a budget; the budget's trade with it).
	assert.InDelta(t, 0.875, pushback.HalfSuccess, 0.05)
	assert.InDelta(t, oneNone.HalfSuccess, pushback.HalfSuccess, 0.05)
	assert.InDelta(t, oneBudget.HalfSuccess, both.HalfSuccess, 0.05)
	assert.Greater(t, naive.HalfSuccess, 0.99, "27 tries succeed, at twice the load")
	assert.InDelta(t, 2.0, naive.HalfSteady, 0.1)
	assert.Less(t, pushback.HalfSteady, naive.HalfSteady)
}

func sumAll(s []int) int {
	n := 0
	for _, v := range s {
		n += v
	}
	return n
}

// The command end to end with 2 runs: tables on stdout, CSV files written.
func TestRunWritesTablesAndCSV(t *testing.T) {
	dir := t.TempDir()
	var out bytes.Buffer
	require.NoError(t, run([]string{"-runs", "2", "-seed", "5", "-out", dir}, &out, io.Discard))
	s := out.String()
	for _, want := range []string{
		"## Contention: write calls per run (mean of 2 runs)",
		"| clients | No backoff | Exponential (no jitter) | Equal jitter | Full jitter | Decorrelated jitter |",
		"| 190 |",
		"## Contention at 100 clients",
		"| token bucket (default) |",
		"## Chain: 20 clients x 25 requests/s -> 2 middle tiers of 5 instances -> bottom",
		"| budgets + pushback |",
	} {
		assert.Contains(t, s, want)
	}
	recs := readCSV(t, filepath.Join(dir, "occ.csv"))
	assert.Len(t, recs, 1+19*len(Strategies))
	recs = readCSV(t, filepath.Join(dir, "outage.csv"))
	assert.Equal(t, []string{"second", "logical", "no budget", "token bucket (default)", "ratio 20% + floor"}, recs[0])
	assert.Greater(t, len(recs), 60)

	for _, png := range []string{"occ-calls.png", "occ-time.png", "outage.png", "chain.png"} {
		assert.FileExists(t, filepath.Join(dir, png))
	}
	recs = readCSV(t, filepath.Join(dir, "chain.csv"))
	assert.Equal(t, []string{"second", "user_requests", "naive (no budget)", "pushback, no budget",
		"budgets (default)", "budgets + pushback"}, recs[0])
	assert.Len(t, recs, 1+51)

	// -chain runs the chain experiment alone.
	chainDir := t.TempDir()
	out.Reset()
	require.NoError(t, run([]string{"-chain", "-out", chainDir}, &out, io.Discard))
	assert.Contains(t, out.String(), "| naive (no budget) | 27.00 | 27.00 |")
	assert.NotContains(t, out.String(), "Contention")
	names, err := os.ReadDir(chainDir)
	require.NoError(t, err)
	assert.Len(t, names, 2, "chain.csv and chain.png")

	assert.Error(t, run([]string{"-runs", "0", "-out", dir}, &out, io.Discard))
	assert.Error(t, run([]string{"-nope"}, &out, io.Discard))
}

// -h and -help print the usage and exit 0, like the chaos demo's; a bad
// command line exits 2.
func TestExitStatus(t *testing.T) {
	for _, arg := range []string{"-h", "-help"} {
		var stderr bytes.Buffer
		assert.Equal(t, 0, realMain([]string{arg}, io.Discard, &stderr), arg)
		assert.True(t, strings.HasPrefix(stderr.String(), "Usage: go run ./examples/fleetsim"), arg)
		assert.Contains(t, stderr.String(), "-runs", arg)
		assert.NotContains(t, stderr.String(), "help requested", arg)
	}
	assert.Equal(t, 2, realMain([]string{"-nope"}, io.Discard, io.Discard))
	assert.Equal(t, 2, realMain([]string{"-runs", "0"}, io.Discard, io.Discard))
}

func readCSV(t *testing.T, path string) [][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	require.NoError(t, err)
	return recs
}

// The same outage with the AWS SDKs' bucket, which time does not refill
// (budget.TokenBucketConfig.RefillTime -1): 35 retries per instance, then
// none, against the default bucket's refill of 500 tokens a minute.
func TestOutageAmplificationWithoutTimeRefill(t *testing.T) {
	c := DefaultOutageConfig(1)
	aws := simulateOutage(c, Policy{Name: "token bucket, no time refill", New: func() budget.Budget {
		return budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
	}})
	def := simulateOutage(c, Policies[1])
	t.Logf("amplification during the outage: %.3f without time refill, %.3f with the default refill; "+
		"over the run: %.3f, %.3f", aws.OutageAmplification(), def.OutageAmplification(),
		aws.Amplification(), def.Amplification())
	assert.LessOrEqual(t, aws.OutageAmplification(), 1+float64(35*c.Clients)/float64(aws.OutageRequests)+0.001)
	assert.Less(t, aws.OutageAmplification(), def.OutageAmplification())
	assert.LessOrEqual(t, def.OutageAmplification(), 1.1)
}
