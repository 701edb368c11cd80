package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// parallelism returns the b.SetParallelism argument that makes RunParallel
// start at least clients goroutines (RunParallel starts p*GOMAXPROCS).
func parallelism(clients int) int {
	procs := runtime.GOMAXPROCS(0)
	return (clients + procs - 1) / procs
}

// happyBase returns the base transport and URL of one happy-path
// sub-benchmark: a fresh loopback server answering OK with a fresh
// http.Transport, or the in-memory transport.
func happyBase(b *testing.B, network string) (http.RoundTripper, string) {
	if network == "memory" {
		return MemTransport{}, "http://memory.invalid/resource"
	}
	srv := NewServer(OK)
	base := NewBaseTransport()
	b.Cleanup(func() {
		base.CloseIdleConnections()
		srv.Close()
	})
	return base, srv.URL + "/resource"
}

func get(b *testing.B, url string) *http.Request {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, url, nil)
	if err != nil {
		b.Fatal(err)
	}
	return req
}

func do(client *http.Client, req *http.Request) error {
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	return err
}

// warmUp sends conc concurrent requests, twice, so that the connections a
// concurrency of conc needs are open before the timed loop.
func warmUp(b *testing.B, client *http.Client, url string, conc int) {
	for range 2 {
		var wg sync.WaitGroup
		errs := make(chan error, conc)
		for range conc {
			wg.Go(func() { errs <- do(client, get(b, url)) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkHappy is scenario (a): a GET answered 200 with a 64-byte body,
// at 1 and 16 concurrent clients, over loopback and over MemTransport.
// Within each net/conc group every contender runs once, bare first.
func BenchmarkHappy(b *testing.B) {
	happy(b, func(b *testing.B, url string) *http.Request { return get(b, url) }, false)
}

// postBody is the body of BenchmarkHappyPost's requests.
const postBody = "amount=1&currency=eur"

// BenchmarkHappyPost is BenchmarkHappy for a small POST (a 21-byte form
// body, with the GetBody that http.NewRequest gives a strings.Reader):
// saferetry attaches its automatic key. Each request is new, its body being
// read by the send; making it is part of every contender's figure, bare's
// included.
func BenchmarkHappyPost(b *testing.B) {
	happy(b, func(b *testing.B, url string) *http.Request {
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url,
			strings.NewReader(postBody))
		if err != nil {
			b.Fatal(err)
		}
		return req
	}, true)
}

// happy runs the happy-path benchmark of the requests newReq makes: a new
// one for each send when fresh, else one per client, sent again and again.
func happy(b *testing.B, newReq func(*testing.B, string) *http.Request, fresh bool) {
	for _, network := range []string{"loopback", "memory"} {
		for _, conc := range []int{1, 16} {
			for _, c := range rotated(append(Contenders[:len(Contenders):len(Contenders)], HappyVariants...)) {
				name := fmt.Sprintf("net=%s/conc=%d/client=%s", network, conc, c.Name)
				b.Run(name, func(b *testing.B) {
					base, url := happyBase(b, network)
					client := &http.Client{Transport: c.Wrap(base, DefaultWaits), Timeout: c.ClientTimeout}
					warmUp(b, client, url, conc)
					b.ReportAllocs()
					next := func(req *http.Request) *http.Request {
						if fresh {
							return newReq(b, url)
						}
						return req
					}
					if conc == 1 {
						req := newReq(b, url)
						b.ResetTimer()
						for range b.N {
							if err := do(client, next(req)); err != nil {
								b.Fatal(err)
							}
						}
						return
					}
					b.SetParallelism(parallelism(conc))
					b.ResetTimer()
					b.RunParallel(func(pb *testing.PB) {
						req := newReq(b, url)
						for pb.Next() {
							if err := do(client, next(req)); err != nil {
								b.Error(err)
								return
							}
						}
					})
				})
			}
		}
	}
}

// payload64K is the body of the POST benchmark.
var payload64K = bytes.Repeat([]byte("0123456789abcdef"), 64<<10/16)

// BenchmarkPost64K is the 64 KiB POST of scenario (a): the request has a
// GetBody that returns fresh readers over the same slice, so a contender
// never needs to copy it. copied-B/op counts bytes the base transport sent
// that the layer had buffered beforehand (a copy); reread-B/op counts bytes
// read from the caller's readers beyond one pass.
func BenchmarkPost64K(b *testing.B) {
	for _, network := range []string{"loopback", "memory"} {
		for _, c := range rotated(Contenders) {
			b.Run(fmt.Sprintf("net=%s/client=%s", network, c.Name), func(b *testing.B) {
				base, url := happyBase(b, network)
				client := &http.Client{Transport: c.Wrap(ProbeTransport{Base: base}, DefaultWaits)}
				tmpl, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url, nil)
				if err != nil {
					b.Fatal(err)
				}
				var origin, sent, direct int64
				post := func() error {
					p := &Probe{}
					req := tmpl.WithContext(WithProbe(context.Background(), p))
					req.Header = http.Header{"Content-Type": {"application/octet-stream"}}
					req.ContentLength = int64(len(payload64K))
					req.Body = CountingBody(payload64K, p)
					req.GetBody = func() (io.ReadCloser, error) { return CountingBody(payload64K, p), nil }
					err := do(client, req)
					origin += p.Origin.Load()
					sent += p.Sent.Load()
					direct += p.Direct.Load()
					return err
				}
				if err := post(); err != nil { // warm-up: opens the connection
					b.Fatal(err)
				}
				origin, sent, direct = 0, 0, 0
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					if err := post(); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				n := float64(b.N)
				b.ReportMetric(float64(sent-direct)/n, "copied-B/op")
				b.ReportMetric(float64(origin-int64(b.N)*int64(len(payload64K)))/n, "reread-B/op")
			})
		}
	}
}

// rotated returns xs rotated left by the BENCH_ROTATE environment variable
// (0 or unset: as given). run.sh sets it to the round number, so that no
// contender always runs first (or last) in its group: a position in the
// process (warm-up, the state of the collector) must not become a ratio.
func rotated[T any](xs []T) []T {
	k, _ := strconv.Atoi(os.Getenv("BENCH_ROTATE"))
	if len(xs) == 0 || k <= 0 {
		return xs
	}
	k %= len(xs)
	return append(xs[k:len(xs):len(xs)], xs[:k]...)
}
