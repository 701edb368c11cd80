// Command chain runs a chain of three services on loopback, each its own
// http.Server, and a client: client -> front -> middle -> bottom. The
// bottom fails; every layer retries with a saferetry Transport (3 attempts,
// the default). It runs the same user requests twice, without and with
// pushback, and prints how many requests reach the bottom per user request.
//
// Without pushback every layer retries, and the retries multiply
// (docs/CHAIN.md). With pushback every service runs behind
// deadline.Middleware: the middle's call to the bottom gives up after its 3
// attempts, so the middleware marks the middle's 503 "Retried-Below: true",
// and neither the front nor the client retries a marked answer: 3 at the
// bottom.
//
//	go run ./examples/chain [-requests 20] [-concurrency 10] [-fail 1] [-budgets]
//	                        [-base 50ms] [-seed 1]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/jitter"
)

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `Usage: go run ./examples/chain [flags]

Runs three services on loopback, each its own http.Server, and a client:
client -> front -> middle -> bottom. The bottom fails (503); every layer
retries with a saferetry Transport, 3 attempts. The same user requests run
twice: without pushback (no service behind deadline.Middleware), then with
it (every service behind it), and the command prints the requests that
reach the bottom per user request. It exits 1 when pushback does not keep
them at most 3 per user request (the middle's own attempts).

Flags:
`

// config is the command line.
type config struct {
	requests    int           // user requests per run
	concurrency int           // user requests in flight at once
	fail        float64       // the share of requests the bottom fails
	budgets     bool          // each service's Transport has a default retry budget
	base        time.Duration // the backoff base of every layer
	seed        uint64        // of the bottom's failures when fail < 1
}

// realMain runs the command and returns its exit status: 0 on success and
// for -h, 2 for a bad command line, 1 when the run fails its check.
func realMain(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case err != nil:
		fmt.Fprintln(stderr, "chain:", err)
		return 2
	}
	ok, err := run(context.Background(), cfg, stdout)
	switch {
	case err != nil:
		fmt.Fprintln(stderr, "chain:", err)
		return 1
	case !ok:
		return 1
	}
	return 0
}

func parseFlags(args []string, w io.Writer) (config, error) {
	cfg := config{}
	fs := flag.NewFlagSet("chain", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() {
		fmt.Fprint(w, usage)
		fs.PrintDefaults()
	}
	fs.IntVar(&cfg.requests, "requests", 20, "user requests per run")
	fs.IntVar(&cfg.concurrency, "concurrency", 10, "user requests in flight at once")
	fs.Float64Var(&cfg.fail, "fail", 1, "share of requests the bottom fails with 503 (1: a full outage)")
	fs.BoolVar(&cfg.budgets, "budgets", false,
		"give each service's Transport a default retry budget (a token bucket per host), as each process has")
	fs.DurationVar(&cfg.base, "base", 50*time.Millisecond,
		"backoff base of every layer, with full jitter as the Transport's default")
	fs.Uint64Var(&cfg.seed, "seed", 1, "seed of the bottom's failures when -fail is below 1")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	switch {
	case fs.NArg() > 0:
		return cfg, fmt.Errorf("unexpected arguments: %q", fs.Args())
	case cfg.requests < 1:
		return cfg, fmt.Errorf("-requests must be at least 1, got %d", cfg.requests)
	case cfg.concurrency < 1:
		return cfg, fmt.Errorf("-concurrency must be at least 1, got %d", cfg.concurrency)
	case !(cfg.fail >= 0 && cfg.fail <= 1):
		return cfg, fmt.Errorf("-fail must be between 0 and 1, got %v", cfg.fail)
	case cfg.base <= 0:
		return cfg, fmt.Errorf("-base must be positive, got %v", cfg.base)
	}
	return cfg, nil
}

// userHeader carries the user request's number down the chain, so that the
// bottom can count the requests of each.
const userHeader = "X-User-Request"

// result is one run of the user requests.
type result struct {
	pushback  bool
	succeeded int
	received  [3]int64 // requests received by the front, the middle and the bottom
	retries   [3]int64 // of which retries (deadline.Attempt above 1; with pushback only)
	perUser   []int64  // requests at the bottom, per user request
}

func (r result) amplification() float64 {
	var sum int64
	for _, n := range r.perUser {
		sum += n
	}
	return float64(sum) / float64(len(r.perUser))
}

func run(ctx context.Context, cfg config, w io.Writer) (bool, error) {
	budgetText := "no retry budget"
	if cfg.budgets {
		budgetText = "a default retry budget per service (a token bucket per host)"
	}
	fmt.Fprintf(w, "chain: client -> front -> middle -> bottom, each service its own http.Server on loopback;\n"+
		"3 attempts per layer (the Transport's default), %s; the bottom fails %.0f%% of requests with 503.\n"+
		"%d user requests, %d at a time.\n\n", budgetText, 100*cfg.fail, cfg.requests, cfg.concurrency)
	var rs []result
	for _, pushback := range []bool{false, true} {
		r, err := runChain(ctx, cfg, pushback)
		if err != nil {
			return false, err
		}
		rs = append(rs, r)
	}
	report(w, cfg, rs)
	on := rs[1]
	if cfg.fail == 1 && slices.Max(on.perUser) > 3 {
		fmt.Fprintf(w, "\nFAIL: with pushback, a user request made %d requests reach the bottom (at most 3)\n",
			slices.Max(on.perUser))
		return false, nil
	}
	fmt.Fprintln(w, "\nWith pushback the middle retries and the layers above do not: it answers its 503 with")
	fmt.Fprintln(w, "\"Retried-Below: true\", which no saferetry Transport retries (stop reason retried_below).")
	return true, nil
}

func report(w io.Writer, cfg config, rs []result) {
	row := func(name string, cell func(result) string) {
		fmt.Fprintf(w, "%-34s", name)
		for _, r := range rs {
			fmt.Fprintf(w, " %18s", cell(r))
		}
		fmt.Fprintln(w)
	}
	row("", func(r result) string {
		if r.pushback {
			return "pushback on"
		}
		return "pushback off"
	})
	row("user requests", func(r result) string { return strconv.Itoa(len(r.perUser)) })
	row("succeeded", func(r result) string { return strconv.Itoa(r.succeeded) })
	for i, name := range []string{"front", "middle", "bottom"} {
		row(name+" received", func(r result) string {
			if !r.pushback {
				return strconv.FormatInt(r.received[i], 10)
			}
			return fmt.Sprintf("%d (%d retries)", r.received[i], r.retries[i])
		})
	}
	row("bottom requests per user request", func(r result) string { return fmt.Sprintf("%.2f", r.amplification()) })
	row("  the most for one user request", func(r result) string { return strconv.FormatInt(slices.Max(r.perUser), 10) })
	if cfg.budgets {
		fmt.Fprintln(w, "\nbottom requests per user request, in the order the user requests started:")
		for _, r := range rs {
			s := make([]string, len(r.perUser))
			for i, n := range r.perUser {
				s[i] = strconv.FormatInt(n, 10)
			}
			fmt.Fprintf(w, "  pushback %-3s %s\n", map[bool]string{false: "off", true: "on"}[r.pushback],
				strings.Join(s, " "))
		}
	}
	fmt.Fprintln(w, "\n(retries: requests whose Request-Attempt, read by deadline.Middleware, is above 1)")
}

// service is one service of the chain: an http.Server on a loopback port.
type service struct {
	srv      *http.Server
	url      string
	received atomic.Int64
	retries  atomic.Int64
	done     chan struct{}
}

func start(h http.Handler, pushback bool) (*service, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &service{url: "http://" + ln.Addr().String(), done: make(chan struct{})}
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.received.Add(1)
		if deadline.Attempt(r.Context()) > 1 {
			s.retries.Add(1)
		}
		h.ServeHTTP(w, r)
	})
	var handler http.Handler = counted
	if pushback {
		handler = deadline.Middleware(counted)
	}
	s.srv = &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

func (s *service) stop() {
	_ = s.srv.Close()
	<-s.done
}

// newTransport is one layer's retrying Transport: the defaults, silent,
// with an unlimited budget or a default one of its own.
func newTransport(cfg config) (*saferetry.Transport, *http.Transport) {
	base := &http.Transport{MaxIdleConnsPerHost: 4 * cfg.concurrency}
	b := budget.Budget(budget.Unlimited())
	if cfg.budgets {
		b = budget.NewRegistry(nil)
	}
	return saferetry.NewTransport(base, saferetry.WithLogger(nil), saferetry.WithBudget(b),
		saferetry.WithBackoff(jitter.Config{Base: cfg.base})), base
}

// relay is the handler of the front and the middle: it calls next with the
// request's context (which carries the record deadline.Middleware made) and
// answers with the status it got, or 502 without one.
func relay(next string, tr http.RoundTripper) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, next, nil)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		req.Header.Set(userHeader, r.Header.Get(userHeader))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			http.Error(w, "bad gateway", http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, io.LimitReader(resp.Body, 1<<20))
	}
}

func runChain(ctx context.Context, cfg config, pushback bool) (result, error) {
	res := result{pushback: pushback, perUser: make([]int64, cfg.requests)}
	perUser := make([]atomic.Int64, cfg.requests)
	var mu sync.Mutex
	coin := rand.New(rand.NewPCG(cfg.seed, 1))
	bottom, err := start(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, err := strconv.Atoi(r.Header.Get(userHeader)); err == nil && n >= 0 && n < len(perUser) {
			perUser[n].Add(1)
		}
		mu.Lock()
		fail := coin.Float64() < cfg.fail
		mu.Unlock()
		if fail {
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok")
	}), pushback)
	if err != nil {
		return res, err
	}
	defer bottom.stop()
	next := bottom.url
	var bases []*http.Transport
	defer func() {
		for _, b := range bases {
			b.CloseIdleConnections()
		}
	}()
	services := []*service{bottom}
	for range 2 { // the middle, then the front
		tr, base := newTransport(cfg)
		bases = append(bases, base)
		s, err := start(relay(next, tr), pushback)
		if err != nil {
			return res, err
		}
		defer s.stop()
		services = append([]*service{s}, services...)
		next = s.url
	}
	client, base := newTransport(cfg)
	bases = append(bases, base)

	var ok atomic.Int64
	var wg sync.WaitGroup
	work := make(chan int)
	errs := make(chan error, cfg.concurrency)
	for range cfg.concurrency {
		wg.Go(func() {
			for i := range work {
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, next, nil)
				if err != nil {
					errs <- err
					return
				}
				req.Header.Set(userHeader, strconv.Itoa(i))
				resp, err := client.RoundTrip(req)
				if err != nil {
					continue // the front unreachable: a failed user request
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					ok.Add(1)
				}
			}
		})
	}
	for i := range cfg.requests {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return res, err
	}
	res.succeeded = int(ok.Load())
	for i, s := range services {
		res.received[i], res.retries[i] = s.received.Load(), s.retries.Load()
	}
	for i := range perUser {
		res.perUser[i] = perUser[i].Load()
	}
	return res, nil
}
