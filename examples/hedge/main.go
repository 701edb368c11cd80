// Command hedge shows hedged requests that are safe for writes: a payments
// API behind the idempotency middleware (memory store), on loopback, where
// a few charges straggle, called twice by a saferetry Transport, without
// and with WithHedging. Every hedge of a POST carries the key of the
// attempt it hedges, so the middleware answers the loser with the
// in-progress 409 (the first attempt still running) or the replay (the
// first attempt done): each charge takes effect once, and the charges that
// were stuck on their way in come back in about the hedge delay.
//
//	go run ./examples/hedge [-n 200] [-delay 20ms] [-straggle 500ms]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	if _, err := run(context.Background(), os.Stdout, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "hedge:", err)
		os.Exit(1)
	}
}

const usage = `Usage: go run ./examples/hedge [-n 200] [-delay 20ms] [-straggle 500ms]

Sends -n charges (POST, 10 at a time) to a local payments API behind the
idempotency middleware (memory store, loopback only), twice: without
hedging, then with saferetry.WithHedging(saferetry.Hedging{Delay: -delay}).
Every 50th charge is stuck for -straggle before it reaches the service (a
queue, a stalled instance), and one charge's handler itself takes
-straggle. It prints the latencies, the requests per charge, what the
middleware answered the losers, and the effects per charge: one each.

Flags:
`

// config is what the flags set.
type config struct {
	n        int
	delay    time.Duration
	straggle time.Duration
}

// parseFlags reads the command line: it returns flag.ErrHelp after writing
// the usage to w for -h, and an error for anything else it cannot use.
func parseFlags(args []string, w io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("hedge", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.IntVar(&c.n, "n", 200, "charges per run")
	fs.DurationVar(&c.delay, "delay", 20*time.Millisecond,
		"the hedge delay (0: adaptive, the host's p95)")
	fs.DurationVar(&c.straggle, "straggle", 500*time.Millisecond,
		"how long a straggling charge is stuck")
	fs.Usage = func() {
		fmt.Fprint(w, usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		fs.Usage()
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	case c.n < 1:
		return c, fmt.Errorf("-n %d: want at least 1", c.n)
	case c.delay < 0 || c.straggle < 0:
		return c, errors.New("-delay and -straggle must not be negative")
	}
	return c, nil
}

// service is the payments API: a front that holds the stragglers, the
// idempotency middleware, and a handler that counts the effects per key.
type service struct {
	straggle time.Duration
	effects  sync.Map // key -> *atomic.Int64
	total    atomic.Int64
	requests atomic.Int64
	inFlight sync.WaitGroup
	// What the middleware answered: 201s that ran the handler, replays,
	// in-progress 409s, anything else.
	ran, replayed, inProgress, other atomic.Int64
}

// stuck reports whether charge n is held before it reaches the service:
// every 50th, on its first attempt (a hedge goes another way).
func stuck(n int) bool { return n%50 == 7 }

// slowHandler reports whether charge n's handler is slow: one charge.
func slowHandler(n int) bool { return n == 123 }

func (s *service) handler() http.Handler {
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		c, _ := s.effects.LoadOrStore(key, &atomic.Int64{})
		c.(*atomic.Int64).Add(1)
		s.total.Add(1)
		n, _ := strconv.Atoi(r.URL.Query().Get("order"))
		if slowHandler(n) {
			time.Sleep(s.straggle) // the charge itself is slow: a hedge cannot help
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d,"status":"charged"}`, n)
	})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(nil))
	guarded := mw.Wrap(charge)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.inFlight.Add(1)
		defer s.inFlight.Done()
		s.requests.Add(1)
		n, _ := strconv.Atoi(r.URL.Query().Get("order"))
		if stuck(n) && r.Header.Get("Request-Attempt") == "1" {
			time.Sleep(s.straggle) // stuck on the way in: it reaches the middleware late
		}
		rec := &recorder{ResponseWriter: w}
		guarded.ServeHTTP(rec, r)
		switch {
		case rec.status == http.StatusCreated && w.Header().Get(idempotency.ReplayedHeader) == "true":
			s.replayed.Add(1)
		case rec.status == http.StatusCreated:
			s.ran.Add(1)
		case rec.status == http.StatusConflict:
			s.inProgress.Add(1)
		default:
			s.other.Add(1)
		}
	})
}

type recorder struct {
	http.ResponseWriter
	status int
}

func (r *recorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

// result is one run's figures.
type result struct {
	name                string
	latencies           []time.Duration // sorted
	requests            int64           // what reached the service
	effects, maxPerKey  int64
	keys                int
	ran, replayed, busy int64
	other               int64
}

// run makes the two runs and prints their figures.
func run(ctx context.Context, w io.Writer, cfg config) ([]result, error) {
	fmt.Fprintf(w, "%d charges (POST /charges, 10 at a time) through the idempotency middleware;\n",
		cfg.n)
	fmt.Fprintf(w, "every 50th is stuck %v on its way in, one handler takes %v.\n\n",
		cfg.straggle, cfg.straggle)
	hedged := fmt.Sprintf("hedged after %v", cfg.delay)
	if cfg.delay == 0 {
		hedged = "hedged, adaptive" // the host's p95, once it has 20 answers
	}
	runs := []struct {
		name string
		opts []saferetry.Option
	}{
		{"no hedging", nil},
		{hedged, []saferetry.Option{saferetry.WithHedging(saferetry.Hedging{Delay: cfg.delay})}},
	}
	var results []result
	for i, r := range runs {
		res, err := charge(ctx, cfg, i, r.name, r.opts)
		if err != nil {
			return results, err
		}
		results = append(results, res)
	}
	fmt.Fprintf(w, "%-20s %9s %9s %9s %17s %15s\n", "", "p50", "p99", "max", "requests/charge",
		"effects/charge")
	for _, r := range results {
		p50 := quantile(r.latencies, 0.5).Round(10 * time.Microsecond)
		p99 := quantile(r.latencies, 0.99).Round(10 * time.Microsecond)
		top := r.latencies[len(r.latencies)-1].Round(time.Millisecond)
		fmt.Fprintf(w, "%-20s %9v %9v %9v %17.3f %15s\n", r.name, p50, p99, top,
			float64(r.requests)/float64(cfg.n), perKey(r))
	}
	h := results[1]
	for _, line := range []string{
		fmt.Sprintf("\nWith hedging, the middleware ran %d charges and answered the losers: %d with the",
			h.ran, h.busy),
		fmt.Sprintf("in-progress 409 (the first attempt still running), %d with the replay (the first",
			h.replayed),
		fmt.Sprintf("attempt done, or stuck and arriving after its hedge won): %d duplicate effects.",
			h.effects-int64(h.keys)),
		"The stuck charges come back in about the hedge delay.",
	} {
		fmt.Fprintln(w, line)
	}
	if cfg.n > 123 {
		fmt.Fprintln(w, "The one whose handler was slow does not: its hedge found it in progress, and the")
		fmt.Fprintln(w, "Transport waited for its answer.")
	}
	return results, nil
}

// charge sends cfg.n charges through a Transport with opts and returns the
// run's figures, once every request the service received has ended.
func charge(ctx context.Context, cfg config, round int, name string,
	opts []saferetry.Option) (result, error) {
	svc := &service{straggle: cfg.straggle}
	ts := httptest.NewServer(svc.handler())
	defer ts.Close()
	base := http.DefaultTransport.(*http.Transport).Clone()
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: saferetry.NewTransport(base, append([]saferetry.Option{
		saferetry.WithLogger(nil),
		// This program's own budget: every Transport of a process shares
		// one per host by default.
		saferetry.WithBudget(budget.NewRegistry(nil)),
	}, opts...)...)}

	latencies := make([]time.Duration, cfg.n)
	errs := make(chan error, cfg.n)
	next := atomic.Int64{}
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			for {
				n := int(next.Add(1)) - 1
				if n >= cfg.n {
					return
				}
				start := time.Now()
				if err := post(ctx, client, ts.URL, round, n); err != nil {
					errs <- err
					return
				}
				latencies[n] = time.Since(start)
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return result{}, err
	}
	svc.inFlight.Wait() // the stuck first attempts reach the middleware, late

	res := result{name: name, latencies: latencies, requests: svc.requests.Load(),
		effects: svc.total.Load(), ran: svc.ran.Load(), replayed: svc.replayed.Load(),
		busy: svc.inProgress.Load(), other: svc.other.Load()}
	svc.effects.Range(func(_, v any) bool {
		res.keys++
		res.maxPerKey = max(res.maxPerKey, v.(*atomic.Int64).Load())
		return true
	})
	slices.Sort(res.latencies)
	return res, nil
}

// post sends charge n of a run, with a key derived from the order, and
// checks that it was charged.
func post(ctx context.Context, client *http.Client, url string, round, n int) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/charges?order="+strconv.Itoa(n),
		strings.NewReader(fmt.Sprintf(`{"order":%d,"amount":100}`, n)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer demo-merchant")
	req.Header.Set("Idempotency-Key", keygen.Event("charge", strconv.Itoa(round), strconv.Itoa(n)))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("charge %d: %w", n, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return fmt.Errorf("charge %d: %w", n, err)
	}
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("charge %d: %s", n, resp.Status)
	}
	return nil
}

// quantile returns the q-quantile of sorted (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func perKey(r result) string {
	if r.maxPerKey == 1 && int64(r.keys) == r.effects {
		return fmt.Sprintf("1 (%d in all)", r.effects)
	}
	return fmt.Sprintf("up to %d (%d for %d)", r.maxPerKey, r.effects, r.keys)
}
