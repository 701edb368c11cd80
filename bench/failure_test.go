package bench

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
)

// seqHeader carries the index of the logical request (0..b.N-1), so that the
// server can tell the attempts of one logical request apart from another's.
const seqHeader = "X-Bench-Request"

// failureRun is the state of one failure sub-benchmark.
type failureRun struct {
	n        int
	attempts []atomic.Int32 // hits per logical request
	tailHits atomic.Int64   // hits of logical requests in the second half
	ok       atomic.Int64   // logical requests that ended in a 2xx
}

func newFailureRun(n int) *failureRun {
	return &failureRun{n: n, attempts: make([]atomic.Int32, n)}
}

// attempt records a hit and returns which attempt of its logical request it
// is (1-based), or 0 when the request carries no valid sequence number.
func (f *failureRun) attempt(r *http.Request) int {
	seq, err := strconv.Atoi(r.Header.Get(seqHeader))
	if err != nil || seq < 0 || seq >= f.n {
		return 0
	}
	if seq >= f.n/2 {
		f.tailHits.Add(1)
	}
	return int(f.attempts[seq].Add(1))
}

// drive sends b.N logical GETs from clients concurrent goroutines and
// reports hits/op (server hits per logical request), tail-hits/op (the same
// over the second half of the logical requests), success-% and conns (TCP
// connections the server accepted during the whole sub-benchmark).
func (f *failureRun) drive(b *testing.B, srv *Server, client *http.Client, clients int) {
	var next atomic.Int64
	b.SetParallelism(parallelism(clients))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			seq := next.Add(1) - 1
			req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, srv.URL+"/resource", nil)
			if err != nil {
				b.Error(err)
				return
			}
			req.Header.Set(seqHeader, strconv.FormatInt(seq, 10))
			if Outcome(client.Do(req)) {
				f.ok.Add(1)
			}
		}
	})
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(srv.Hits())/n, "hits/op")
	b.ReportMetric(float64(f.tailHits.Load())/float64(f.n-f.n/2), "tail-hits/op")
	b.ReportMetric(100*float64(f.ok.Load())/n, "success-%")
	b.ReportMetric(float64(srv.NewConns()), "conns")
}

// failureClient builds a fresh base transport and the contender over it.
func failureClient(b *testing.B, c Contender, srv *Server) *http.Client {
	base := NewBaseTransport()
	b.Cleanup(func() {
		base.CloseIdleConnections()
		srv.Close()
	})
	return &http.Client{Transport: c.Wrap(base, ScaledWaits)}
}

// BenchmarkTransient is scenario (b): the first 1 or 2 attempts of every
// logical GET are answered 503 (no Retry-After), the next one 200, with 16
// concurrent clients. conns above 16 means the client opened connections
// for retries (it leaked or closed the bodies of retried responses). Run it
// with a fixed -benchtime=Nx: a client that leaks connections holds file
// descriptors until the process ends.
func BenchmarkTransient(b *testing.B) {
	const clients = 16
	for _, fails := range []int{1, 2} {
		for _, c := range Contenders {
			b.Run(fmt.Sprintf("fail=%d/client=%s", fails, c.Name), func(b *testing.B) {
				f := newFailureRun(b.N)
				srv := NewServer(func(w http.ResponseWriter, r *http.Request) {
					if f.attempt(r) <= fails {
						Unavailable(w, r)
						return
					}
					OK(w, r)
				})
				f.drive(b, srv, failureClient(b, c, srv), clients)
			})
		}
	}
}

// splitmix64 is a deterministic bit mixer: a 50% outage fails hit h when
// splitmix64(h) is even, which spreads failures evenly over attempts.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// BenchmarkOutage is scenario (c): 32 concurrent clients against a server
// that answers every request 503 (outage=full) or half of them
// (outage=half, chosen by a deterministic hash of the hit number). hits/op is
// the amplification; tail-hits/op is the amplification once saferetry's
// token bucket has drained; success-% the share of logical requests that got
// a 2xx. Run with a fixed -benchtime=Nx.
func BenchmarkOutage(b *testing.B) {
	const clients = 32
	for _, outage := range []string{"full", "half"} {
		for _, c := range Contenders {
			b.Run(fmt.Sprintf("outage=%s/client=%s", outage, c.Name), func(b *testing.B) {
				f := newFailureRun(b.N)
				var hit atomic.Uint64
				srv := NewServer(func(w http.ResponseWriter, r *http.Request) {
					f.attempt(r)
					h := hit.Add(1)
					if outage == "full" || splitmix64(h)%2 == 0 {
						Unavailable(w, r)
						return
					}
					OK(w, r)
				})
				f.drive(b, srv, failureClient(b, c, srv), clients)
			})
		}
	}
}
