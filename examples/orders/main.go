// Command orders shows what a client does when its retries run out
// without a definitive answer. It sends orders (200 by default) to an
// orders API behind the idempotency middleware on SQLite, through an
// in-process toxiproxy that resets a share of the connections before the
// request reaches the server (the order is never made) and a share after
// the server answered (the order is made, its answer lost). Each order
// carries a key derived from it, and the saferetry client retries under
// its default budget; what it cannot settle is an unknown outcome
// (saferetry.Definitive), which the caller then resolves in rounds, the
// outage over, in one of two ways:
//
//   - without the lookup, it sends every unknown order again, with its
//     key, as a client without a status monitor must;
//   - with the lookup, it asks the API's monitor (Transport.Lookup) what
//     became of each and sends again only the orders the server never
//     got (absent), taking the stored response of the others.
//
// It prints, for each way, the unknown outcomes left to the caller, the
// orders sent again, the lookups, the requests that reached the server
// and the effects, and fails unless every order took effect once:
//
//	go run ./examples/orders
//	go run ./examples/orders -orders 500 -cut-request 0.3 -cut-answer 0.5
//
// With -serve, it serves the API alone (with POST /charges, a charge at the
// card processor of -processor) over SQLite or PostgreSQL until it is
// killed, printing "listening on HOST:PORT" first: the server process of
// the crash test.
package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/keygen"
)

type config struct {
	orders       int
	cutRequest   float64 // share of the connections reset before the server
	cutAnswer    float64 // share reset after the server answered
	outageRounds int     // resolution rounds during which the faults go on
	maxRounds    int
	workers      int

	serve       string // -serve: the address to serve on
	driver, dsn string
	processor   string
	lease       time.Duration
	completer   time.Duration
	acceptAfter time.Duration
	secret      string // hex
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("orders", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.orders, "orders", 200, "orders to send")
	fs.Float64Var(&cfg.cutRequest, "cut-request", 0.3,
		"share of the connections reset before the request reaches the server")
	fs.Float64Var(&cfg.cutAnswer, "cut-answer", 0.5,
		"share of the connections reset after the server answered")
	fs.IntVar(&cfg.outageRounds, "outage-rounds", 0,
		"resolution rounds during which the faults go on (0: the outage is over)")
	fs.IntVar(&cfg.maxRounds, "max-rounds", 10, "resolution rounds at most")
	fs.IntVar(&cfg.workers, "workers", 16, "orders in flight at once")
	fs.StringVar(&cfg.serve, "serve", "", "serve the API alone on this address")
	fs.StringVar(&cfg.driver, "driver", "sqlite", `-serve: "sqlite" or "pgx"`)
	fs.StringVar(&cfg.dsn, "dsn", "", "-serve: the SQLite file, or the PostgreSQL DSN")
	fs.StringVar(&cfg.processor, "processor", "", "-serve: the card processor's URL")
	fs.DurationVar(&cfg.lease, "lease", 0, "-serve: the idempotency lease (0: the default)")
	fs.DurationVar(&cfg.completer, "completer", 0, "-serve: run a Completer at this interval")
	fs.DurationVar(&cfg.acceptAfter, "accept-after", 0, "-serve: answer 202 past this time")
	fs.StringVar(&cfg.secret, "secret", "", "-serve: the monitor's secret, hex (32 bytes or more)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if cfg.orders < 1 || cfg.workers < 1 || cfg.maxRounds < 1 || cfg.cutRequest < 0 ||
		cfg.cutRequest > 1 || cfg.cutAnswer < 0 || cfg.cutAnswer > 1 {
		return cfg, errors.New("orders: -orders, -workers and -max-rounds must be positive, " +
			"-cut-request and -cut-answer within 0..1")
	}
	return cfg, nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.serve != "" {
		err = serve(ctx, cfg, os.Stdout)
	} else {
		var figs []figures
		figs, err = run(ctx, cfg, os.Stdout)
		for _, f := range figs {
			if err == nil && !f.ok(cfg.orders) {
				err = errors.New("FAIL: an order took effect twice or never, or its caller " +
					"does not know its outcome")
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

// figures is what one way of resolving the unknown outcomes came to.
type figures struct {
	mode              string
	unknownAfterLoop  int   // unknown outcomes the client's loop left
	leftUnknown       int   // unknown outcomes left after the rounds
	rounds            int   // resolution rounds run
	resends           int   // orders sent again by the caller
	lookups           int   // lookups the caller asked
	lookupFailures    int   // lookups whose own outcome was unknown
	reachedPOST       int64 // POST requests that reached the server, retries included
	reachedGET        int64 // requests to its monitor
	effects           int   // orders made
	duplicated        int   // keys with more than one order
	answeredWithOrder int   // orders whose caller ended with the response naming their order
}

// ok reports whether every order took effect once and its caller knows it.
func (f figures) ok(orders int) bool {
	return f.effects == orders && f.duplicated == 0 && f.leftUnknown == 0 &&
		f.answeredWithOrder == orders
}

// run sends the orders once per way of resolving and prints the figures.
func run(ctx context.Context, cfg config, out io.Writer) ([]figures, error) {
	dir, err := os.MkdirTemp("", "orders-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	fmt.Fprintf(out, "%d orders through toxiproxy: %.0f%% of connections reset before the "+
		"server, %.0f%% after its answer; client: 3 attempts, the default retry budget\n",
		cfg.orders, 100*cfg.cutRequest, 100*cfg.cutAnswer)
	var figs []figures
	for _, lookup := range []bool{false, true} {
		f, err := runMode(ctx, cfg, lookup, dir)
		if err != nil {
			return figs, err
		}
		figs = append(figs, f)
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, v func(f figures) any) {
		fmt.Fprintf(tw, "%s\t%v\t%v\t\n", name, v(figs[0]), v(figs[1]))
	}
	row("", func(f figures) any { return f.mode })
	row("unknown outcomes after the client's retries",
		func(f figures) any { return f.unknownAfterLoop })
	row("resolution rounds", func(f figures) any { return f.rounds })
	row("orders sent again (re-sends)", func(f figures) any { return f.resends })
	row("lookups", func(f figures) any { return f.lookups })
	row("lookups without an answer", func(f figures) any { return f.lookupFailures })
	row("POSTs that reached the server", func(f figures) any { return f.reachedPOST })
	row("lookups that reached the server", func(f figures) any { return f.reachedGET })
	row("requests that reached the server",
		func(f figures) any { return f.reachedPOST + f.reachedGET })
	row("unknown outcomes left to the caller", func(f figures) any { return f.leftUnknown })
	row("orders made (effects)", func(f figures) any { return f.effects })
	row("keys with more than one order", func(f figures) any { return f.duplicated })
	if err := tw.Flush(); err != nil {
		return figs, err
	}
	for _, f := range figs {
		verdict := "PASS"
		if !f.ok(cfg.orders) {
			verdict = "FAIL"
		}
		fmt.Fprintf(out, "%s %s: %d orders, %d effects, %d known to their caller\n", verdict,
			f.mode, cfg.orders, f.effects, f.answeredWithOrder)
	}
	return figs, nil
}

// runMode sends the orders through a fresh API, store and proxy, then
// resolves their unknown outcomes with or without the lookup.
func runMode(ctx context.Context, cfg config, withLookup bool, dir string) (figures, error) {
	f := figures{mode: "without lookup"}
	if withLookup {
		f.mode = "with lookup"
	}
	st, err := openStore(ctx, "sqlite", filepath.Join(dir, strings.ReplaceAll(f.mode, " ", "-")+
		".db"), false)
	if err != nil {
		return f, err
	}
	defer st.close()
	svc := newService(st, serviceConfig{secret: randomSecret(),
		logger: slog.New(slog.DiscardHandler)})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return f, err
	}
	srv := &http.Server{Handler: svc.handler, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()

	proxy := toxiproxy.NewProxy(newToxiproxyServer(), "orders", "127.0.0.1:0",
		ln.Addr().String())
	if err := proxy.Start(); err != nil {
		return f, fmt.Errorf("starting toxiproxy: %w", err)
	}
	defer proxy.Stop()
	faults := &faults{proxy: proxy, cutRequest: cfg.cutRequest, cutAnswer: cfg.cutAnswer}

	// A connection per request, so that every attempt meets the faults
	// afresh; the default budget, fresh for each way.
	tr := saferetry.NewTransport(&http.Transport{DisableKeepAlives: true},
		saferetry.WithBudget(budget.NewRegistry(nil)),
		saferetry.WithAttemptTimeout(5*time.Second),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))
	c := &caller{tr: tr, client: &http.Client{Transport: tr}, api: "http://" + proxy.Listen,
		final: map[string]string{}}
	keys := make([]string, cfg.orders)
	for i := range keys {
		keys[i] = keygen.Event("order", fmt.Sprintf("%04d", i+1))
	}

	if err := faults.set(true); err != nil {
		return f, err
	}
	unknown := c.each(ctx, keys, cfg.workers, c.send)
	f.unknownAfterLoop = len(unknown)
	for f.rounds = 0; len(unknown) > 0 && f.rounds < cfg.maxRounds; {
		f.rounds++
		if err := faults.set(f.rounds <= cfg.outageRounds); err != nil {
			return f, err
		}
		if withLookup {
			unknown = c.each(ctx, unknown, cfg.workers, c.resolve)
		} else {
			unknown = c.each(ctx, unknown, cfg.workers, c.resend)
		}
	}
	if err := faults.set(false); err != nil {
		return f, err
	}
	f.leftUnknown = len(unknown)
	f.resends, f.lookups, f.lookupFailures = c.counts()
	f.reachedPOST, f.reachedGET = svc.posts.Load(), svc.lookups.Load()
	if f.effects, f.duplicated, err = st.effects(ctx); err != nil {
		return f, err
	}
	for _, key := range keys {
		id, err := st.orderID(ctx, account, key)
		if err == nil && c.final[key] == fmt.Sprintf(`{"order":%d,"amount":4200}`, id) {
			f.answeredWithOrder++
		}
	}
	return f, ctx.Err()
}

// account is the principal every order is sent for.
const account = "acct-1"

// caller is the code that calls the API: it sends each order once through
// the saferetry client, and resolves what stays unknown.
type caller struct {
	tr     *saferetry.Transport
	client *http.Client
	api    string

	mu                              sync.Mutex
	final                           map[string]string // key -> the body of its 201
	resends, lookups, lookupsFailed int
}

func (c *caller) counts() (resends, lookups, failed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.resends, c.lookups, c.lookupsFailed
}

// each runs f for every key, workers at once, and returns the keys whose
// outcome is still unknown.
func (c *caller) each(ctx context.Context, keys []string, workers int,
	f func(ctx context.Context, key string) bool) []string {
	next := make(chan string)
	var mu sync.Mutex
	var unknown []string
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for key := range next {
				if !f(ctx, key) {
					mu.Lock()
					unknown = append(unknown, key)
					mu.Unlock()
				}
			}
		})
	}
	for _, k := range keys {
		next <- k
	}
	close(next)
	wg.Wait()
	return unknown
}

func (c *caller) request(ctx context.Context, key string) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.api+"/orders",
		strings.NewReader(`{"amount":4200}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Account", account)
	req.Header.Set("Idempotency-Key", key)
	return req
}

// send sends the order with key and reports whether its outcome is known.
func (c *caller) send(ctx context.Context, key string) bool {
	resp, err := c.client.Do(c.request(ctx, key))
	if !saferetry.Definitive(resp, err) {
		if resp != nil {
			resp.Body.Close()
		}
		return false
	}
	c.settle(key, resp)
	return true
}

// resend sends the order again, with the same key.
func (c *caller) resend(ctx context.Context, key string) bool {
	c.mu.Lock()
	c.resends++
	c.mu.Unlock()
	return c.send(ctx, key)
}

// resolve asks the monitor what became of the order, and sends it again
// only when the server never got it (or has no monitor).
func (c *caller) resolve(ctx context.Context, key string) bool {
	c.mu.Lock()
	c.lookups++
	c.mu.Unlock()
	res, err := c.tr.Lookup(ctx, c.api+"/operations/", c.request(ctx, key), key)
	switch {
	case errors.Is(err, saferetry.ErrNoMonitor):
		return c.resend(ctx, key)
	case err != nil:
		c.mu.Lock()
		c.lookupsFailed++
		c.mu.Unlock()
		return false // still unknown: ask again next round
	case res.State == saferetry.OperationCompleted:
		c.settle(key, res.Response)
		return true
	case res.State == saferetry.OperationAbsent:
		return c.resend(ctx, key)
	}
	return false // in progress: ask again next round
}

// settle keeps the final answer of the order with key.
func (c *caller) settle(key string, resp *http.Response) {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	c.mu.Lock()
	defer c.mu.Unlock()
	if resp.StatusCode == http.StatusCreated {
		c.final[key] = string(b)
	}
}

// faults drives the proxy's two toxics: resets before the server
// (upstream: the request never reaches it) and after it answered
// (downstream: the answer is lost).
type faults struct {
	proxy                 *toxiproxy.Proxy
	cutRequest, cutAnswer float64
	on                    bool
}

func (t *faults) set(on bool) error {
	if on == t.on {
		return nil
	}
	t.on = on
	for _, x := range []struct {
		name, stream string
		share        float64
	}{{"cut_request", "upstream", t.cutRequest}, {"cut_answer", "downstream", t.cutAnswer}} {
		if !on {
			if err := t.proxy.Toxics.RemoveToxic(context.Background(), x.name); err != nil {
				return fmt.Errorf("toxiproxy: %w", err)
			}
			continue
		}
		js := fmt.Sprintf(`{"name":%q,"type":"reset_peer","stream":%q,"toxicity":%g,`+
			`"attributes":{"timeout":0}}`, x.name, x.stream, x.share)
		if _, err := t.proxy.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			return fmt.Errorf("toxiproxy: %w", err)
		}
	}
	return nil
}

// newToxiproxyServer returns the toxiproxy API server that owns the proxy,
// logging nowhere (see examples/chaos).
func newToxiproxyServer() *toxiproxy.ApiServer {
	return withDiscardLogger(toxiproxy.NewServer, toxiproxy.NewMetricsContainer(nil))
}

func withDiscardLogger[M any, L interface{ Output(io.Writer) L }](
	newServer func(M, L) *toxiproxy.ApiServer, m M) *toxiproxy.ApiServer {
	var zero L
	return newServer(m, zero.Output(io.Discard))
}

func randomSecret() []byte {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return b
}

// serve serves the API alone until ctx ends (see -serve).
func serve(ctx context.Context, cfg config, out io.Writer) error {
	secret, err := hex.DecodeString(cfg.secret)
	if err != nil || len(secret) < 32 {
		return errors.New("-serve needs -secret: 32 bytes or more, hex")
	}
	st, err := openStore(ctx, cfg.driver, cfg.dsn, true)
	if err != nil {
		return err
	}
	defer st.close()
	svc := newService(st, serviceConfig{secret: secret, acceptAfter: cfg.acceptAfter,
		lease: cfg.lease, processor: cfg.processor,
		logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{
			Level: slog.LevelWarn}))})
	if cfg.completer > 0 {
		defer svc.mw.Completer(svc.routes).Start(ctx, cfg.completer)()
	}
	ln, err := net.Listen("tcp", cmp.Or(cfg.serve, "127.0.0.1:0"))
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: svc.handler, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(out, "listening on %s\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	}
}
