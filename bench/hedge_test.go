package bench

import (
	"context"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/failsafe-go/failsafe-go/failsafehttp"
	"github.com/failsafe-go/failsafe-go/hedgepolicy"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
)

// The straggler scenario (e): a loopback server answers at once, but holds
// 1 hit in hedgeStraggleEvery for hedgeStraggle (until the request's
// context ends, as a canceled hedge loser's does).
const (
	hedgeStraggle      = time.Second
	hedgeStraggleEvery = 100 // 1% of the hits
	hedgeDelay         = 10 * time.Millisecond
	hedgeClients       = 8   // few enough that a 2-core machine's own latency stays under hedgeDelay
	hedgeWarmUp        = 200 // requests before the timed ones, straggle-free: connections, estimates
)

// HedgeContenders are the clients of the straggler scenario, over the same
// base transport as every other benchmark's:
//   - bare: no hedging (base itself);
//   - saferetry: saferetry's defaults, no hedging;
//   - failsafe-hedge: failsafehttp.NewRoundTripper(base,
//     hedgepolicy.NewBuilderWithDelay[*http.Response](10ms).Build()): one
//     hedge after 10 ms, every outstanding attempt canceled on the first
//     result (its default);
//   - saferetry-hedge: saferetry.WithHedging(saferetry.Hedging{Delay: 10ms}):
//     one hedge after 10 ms;
//   - failsafe-hedge-p95: hedgepolicy.NewBuilderWithDelayQuantile(0.95,
//     512, 20): the delay is the p95 of recent executions (a moving
//     quantile remembering about 512), from the 20th on;
//   - saferetry-hedge-p95: saferetry.WithHedging(saferetry.Hedging{}): the
//     delay is the host's recent p95, clamped to 5 ms..10 s, from the 20th
//     answer on;
//   - saferetry-hedge-nobudget: saferetry-hedge with
//     WithBudget(budget.Unlimited()): what the retry budget's limit on
//     hedges costs and saves (each hedge takes a transient retry's 14
//     tokens, a winning one gets them back, a first-try success adds 1,
//     and time refills the bucket).
var HedgeContenders = []Contender{
	{Name: "bare", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper { return base }},
	{Name: "saferetry", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger))
	}},
	{Name: "failsafe-hedge", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return failsafehttp.NewRoundTripper(base,
			hedgepolicy.NewBuilderWithDelay[*http.Response](hedgeDelay).Build())
	}},
	{Name: "saferetry-hedge", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger),
			saferetry.WithHedging(saferetry.Hedging{Delay: hedgeDelay}))
	}},
	{Name: "failsafe-hedge-p95", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return failsafehttp.NewRoundTripper(base,
			hedgepolicy.NewBuilderWithDelayQuantile[*http.Response](0.95, 512, 20).Build())
	}},
	{Name: "saferetry-hedge-p95", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger),
			saferetry.WithHedging(saferetry.Hedging{}))
	}},
	{Name: "saferetry-hedge-nobudget", Wrap: func(base http.RoundTripper, _ Waits) http.RoundTripper {
		return saferetry.NewTransport(base, saferetry.WithLogger(DiscardLogger),
			saferetry.WithHedging(saferetry.Hedging{Delay: hedgeDelay}),
			saferetry.WithBudget(budget.Unlimited()))
	}},
}

// straggler is the scenario's server: it counts the hits once timed is set,
// and holds every hedgeStraggleEvery-th of them (by a hash of its number,
// so that the stragglers are spread evenly) for hedgeStraggle.
type straggler struct {
	timed atomic.Bool
	hit   atomic.Uint64
}

func (s *straggler) serve(w http.ResponseWriter, r *http.Request) {
	if s.timed.Load() && splitmix64(s.hit.Add(1))%hedgeStraggleEvery == 0 {
		t := time.NewTimer(hedgeStraggle)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	OK(w, r)
}

// BenchmarkHedge is scenario (e): hedgeClients concurrent clients send b.N
// logical GETs (run with a fixed -benchtime=Nx) to a loopback server on
// which 1% of the hits straggle for 1 s. It reports the latency of the
// logical requests (p50-ms, p99-ms, p99.9-ms, max-ms, from the call to the
// end of the body) and extra-%, the server hits beyond one per logical
// request, in percent of the logical requests: what hedging costs the
// server.
func BenchmarkHedge(b *testing.B) {
	for _, c := range rotated(HedgeContenders) {
		b.Run("client="+c.Name, func(b *testing.B) {
			s := &straggler{}
			srv := NewServer(s.serve)
			client := failureClient(b, c, srv)
			url := srv.URL + "/resource"
			for range hedgeWarmUp / hedgeClients {
				warmUp(b, client, url, hedgeClients)
			}
			s.timed.Store(true)
			warm := srv.Hits()

			latencies := make([]time.Duration, b.N)
			var next atomic.Int64
			b.SetParallelism(parallelism(hedgeClients))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := next.Add(1) - 1
					req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, url, nil)
					if err != nil {
						b.Error(err)
						return
					}
					start := time.Now()
					resp, err := client.Do(req)
					if err == nil {
						_, err = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
					if err != nil {
						b.Error(err)
						return
					}
					latencies[i] = time.Since(start)
				}
			})
			b.StopTimer()
			slices.Sort(latencies)
			ms := func(q float64) float64 {
				return float64(latencies[rank(len(latencies), q)]) / float64(time.Millisecond)
			}
			b.ReportMetric(ms(0.5), "p50-ms")
			b.ReportMetric(ms(0.99), "p99-ms")
			b.ReportMetric(ms(0.999), "p99.9-ms")
			b.ReportMetric(ms(1), "max-ms")
			b.ReportMetric(100*float64(srv.Hits()-warm-int64(b.N))/float64(b.N), "extra-%")
		})
	}
}

// rank is the index of the q-quantile of n sorted values (nearest rank).
func rank(n int, q float64) int {
	i := int(q*float64(n)+0.999999) - 1
	return min(max(i, 0), n-1)
}
