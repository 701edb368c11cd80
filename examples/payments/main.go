// Command payments shows both halves of saferetry on a multi-step write: a
// payments API that creates an order, charges a card at an external
// processor and writes a receipt, as atomic phases behind the idempotency
// middleware on embedded SQLite, and a saferetry client that pays an order
// with an event-derived key. Everything runs on loopback in one process and
// a temporary directory:
//
//	go run ./examples/payments
//
// Two faults hit the one logical request: the card processor is down for the
// first charge (the server answers 503 after the order committed), and the
// answer to the second attempt is lost on the way back after the server
// committed. The client retries with the same key; the second attempt
// resumes after the committed order, finds no charge under the downstream
// key and charges once; the third gets the stored response replayed. The
// program prints what happened and checks the database: one order, one
// charge, one receipt.
//
// With -serve, it serves the same payments API (without the faults, and
// with a second account) until interrupted, as a target for idemcheck;
// -delay makes each payment take that long, so that duplicates sent
// meanwhile get the in-progress conflict that idemcheck's in_progress
// check retries after:
//
//	go run ./examples/payments -serve 127.0.0.1:8099 -delay 200ms
package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/jitter"
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
	if cfg.serve != "" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		ln, err := net.Listen("tcp", cfg.serve)
		if err == nil {
			err = serve(ctx, ln, os.Stdout, cfg.delay)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "payments:", err)
			os.Exit(1)
		}
		return
	}
	res, err := run(context.Background(), os.Stdout)
	if err == nil && !res.ok() {
		err = fmt.Errorf("unexpected result: %+v", res)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

const usage = `Usage: go run ./examples/payments [-serve host:port [-delay d]]

Runs a payments API (an order, a card charge and a receipt as atomic phases
behind the idempotency middleware, on embedded SQLite) and a saferetry
client on loopback; a processor outage and a lost answer hit one payment,
and the command checks that it had its effects effectively once within its
key's scope: one order, one charge, one receipt. With -serve it serves the
API as an idemcheck target instead.

Flags:
`

// config is the command line.
type config struct {
	serve string        // -serve: the address to serve on, "" to run the demo
	delay time.Duration // -delay
}

// parseFlags reads the command line: it returns flag.ErrHelp after writing
// the usage to w for -h, and an error for anything it cannot read.
func parseFlags(args []string, w io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("payments", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() {
		fmt.Fprint(w, usage)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.serve, "serve", "", "serve the payments API on `host:port` until interrupted (SIGINT,\n"+
		"SIGTERM), without the demo's faults, instead of running the demo")
	fs.DurationVar(&cfg.delay, "delay", 0, "with -serve, how long each payment takes before its first phase\n"+
		"(duplicates sent meanwhile get 409 in progress)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return cfg, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return cfg, nil
}

// result is what happened, for the test and the final check.
type result struct {
	status           int
	replayed         bool
	body             string
	serverRequests   int // requests that reached the payments API
	orders, receipts int // rows in the business tables
	charges          int // distinct charges at the processor
	chargeCalls      int // charge calls the processor received (one failed)
	lookups          int
	keys             []string // downstream keys the processor saw
	forgedStatus     int      // the answer to the same key without a valid token
}

func (r result) ok() bool {
	return r.status == http.StatusCreated && r.replayed && r.serverRequests == 3 &&
		r.orders == 1 && r.receipts == 1 && r.charges == 1 && r.chargeCalls == 2 && r.lookups == 1 && len(r.keys) == 1 &&
		r.forgedStatus == http.StatusUnauthorized
}

// printer serialises the narrative of the server, processor and client.
type printer struct {
	mu sync.Mutex
	w  io.Writer
}

func (p *printer) say(format string, a ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, format+"\n", a...)
}

// processor is the fake card processor: it de-duplicates charges by
// Idempotency-Key, answers lookups by key, and is down for its first down
// calls.
type processor struct {
	out     *printer
	down    int
	mu      sync.Mutex
	charges map[string]string
	calls   int
	lookups int
}

func (p *processor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/charges":
		key := r.Header.Get("Idempotency-Key")
		p.calls++
		if p.calls <= p.down {
			p.out.say("  processor: down (503), nothing charged")
			http.Error(w, "maintenance", http.StatusServiceUnavailable)
			return
		}
		c, ok := p.charges[key]
		if !ok {
			c = fmt.Sprintf("ch_%d", len(p.charges)+1)
			p.charges[key] = c
			p.out.say("  processor: charged 42.00 EUR as %s (key %s)", c, key)
		} else {
			p.out.say("  processor: duplicate of %s under key %s, not charged again", c, key)
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, c)
	case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/charges/"):
		p.lookups++
		key := strings.TrimPrefix(r.URL.Path, "/charges/") // net/http has unescaped the path
		c, ok := p.charges[key]
		if !ok {
			p.out.say("  processor: lookup %s: no such charge", key)
			http.NotFound(w, r)
			return
		}
		p.out.say("  processor: lookup %s: %s", key, c)
		io.WriteString(w, c)
	default:
		http.NotFound(w, r)
	}
}

// api is the payments API: POST /payments with {"order":"42","amount":4200}.
type api struct {
	db        *sql.DB
	processor string
	client    *http.Client
	out       *printer
	delay     time.Duration // how long a payment takes before its first phase
}

func (a *api) pay(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	run, _ := idempotency.FromContext(ctx)
	var in struct {
		Order  string `json:"order"`
		Amount int64  `json:"amount"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Order == "" || in.Amount <= 0 {
		http.Error(w, `body must be {"order":"...","amount":N}`, http.StatusBadRequest)
		return
	}
	orderRef, amount := in.Order, in.Amount
	if a.delay > 0 { // a slow payment: a duplicate sent meanwhile gets 409
		t := time.NewTimer(a.delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}

	// Phase 1: the order, in the phase's own transaction.
	ran := false
	order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
		ran = true
		tx, _ := sqlstore.Tx(ctx)
		id := "ord_" + orderRef
		_, err := tx.ExecContext(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2)`, id, amount)
		a.out.say("  server: phase order: created %s (commits with recovery point \"order\")", id)
		return []byte(id), err
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	if !ran {
		a.out.say("  server: phase order: committed by an earlier attempt, skipped (%s)", order)
	}

	// Phase 2: the charge, an external call with a recorded intent.
	charge, err := run.External(ctx, "charge",
		func(ctx context.Context, key string) ([]byte, error) {
			a.out.say("  server: phase charge: calling the processor with key %s (the intent is recorded)", key)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, a.processor+"/charges",
				strings.NewReader(fmt.Sprintf(`{"order":%q,"amount":%d}`, string(order), amount)))
			req.Header.Set("Idempotency-Key", key)
			b, status, err := a.do(req)
			if err == nil && status != http.StatusCreated {
				err = fmt.Errorf("processor answered %d", status)
			}
			return b, err
		},
		func(ctx context.Context, key string) ([]byte, bool, error) {
			a.out.say("  server: phase charge: an intent without an outcome; asking the processor first")
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, a.processor+"/charges/"+url.PathEscape(key), nil)
			b, status, err := a.do(req)
			switch {
			case err != nil:
				return nil, false, err
			case status == http.StatusNotFound:
				return nil, false, nil
			case status != http.StatusOK:
				return nil, false, fmt.Errorf("processor lookup answered %d", status)
			}
			return b, true, nil
		})
	if err != nil {
		a.out.say("  server: phase charge failed (%v); answering 503, the order stays committed", errors.Unwrap(err))
		http.Error(w, "card processor unavailable", http.StatusServiceUnavailable)
		return
	}

	// The receipt, in the request's transaction: it commits with the stored
	// response.
	tx, ok := sqlstore.Tx(ctx)
	if !ok {
		http.Error(w, "no transaction", http.StatusServiceUnavailable)
		return
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO receipts (order_id, charge) VALUES ($1, $2)`, string(order), string(charge)); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	a.out.say("  server: receipt for %s/%s written; it commits with the stored response", order, charge)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%q,"charge":%q,"status":"paid"}`, order, charge)
}

func (a *api) do(req *http.Request) ([]byte, int, error) {
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return b, resp.StatusCode, err
}

// faults sits in front of the API: it counts requests and loses the answer
// to the second one after the server committed it (a proxy or the network
// dropping the connection), by closing the connection without a response.
type faults struct {
	next http.Handler
	out  *printer
	n    atomic.Int64
}

func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := f.n.Add(1)
	f.out.say("server: request %d, Idempotency-Key %s", n, r.Header.Get("Idempotency-Key"))
	if n != 2 {
		rec := &recorder{header: http.Header{}}
		f.next.ServeHTTP(rec, r)
		if rec.header.Get(idempotency.ReplayedHeader) == "true" {
			f.out.say("server: answered %d, a replay of the stored response", rec.status)
		} else {
			f.out.say("server: answered %d", rec.status)
		}
		for k, v := range rec.header {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.status)
		_, _ = w.Write(rec.body.Bytes())
		return
	}
	rec := &recorder{header: http.Header{}}
	f.next.ServeHTTP(rec, r)
	f.out.say("server: answered %d, but the connection drops before the client reads it", rec.status)
	if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
		_ = conn.Close()
	}
}

// recorder buffers a response.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}
func (r *recorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(p)
}

// app is the payments API on SQLite behind the middleware, with its card
// processor.
type app struct {
	db      *sql.DB
	proc    *processor
	handler http.Handler // POST /payments
	close   func()
}

// newApp opens the database in dir, creates the tables and returns the API;
// the processor is down for its first down charges.
func newApp(ctx context.Context, dir string, out *printer, down int, delay time.Duration) (*app, error) {
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(dir, "payments.db")))
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(4)
	store, err := sqlstore.Open(db, sqlstore.SQLite)
	if err == nil {
		err = store.Migrate(ctx)
	}
	// No unique constraint on an order: under -serve each new key is a new
	// payment (idemcheck pays order 42 under many keys), and a second
	// execution of one request adds a row that the demo's final count shows.
	for _, ddl := range []string{
		`CREATE TABLE orders (id TEXT NOT NULL, amount INTEGER NOT NULL)`,
		`CREATE TABLE receipts (order_id TEXT NOT NULL, charge TEXT NOT NULL)`,
	} {
		if err == nil {
			_, err = db.ExecContext(ctx, ddl)
		}
	}
	if err != nil {
		_ = db.Close()
		return nil, err
	}

	proc := &processor{out: out, down: down, charges: map[string]string{}}
	procSrv := httptest.NewServer(proc)
	transport := &http.Transport{}
	a := &api{db: db, processor: procSrv.URL, client: &http.Client{Transport: transport, Timeout: 5 * time.Second},
		out: out, delay: delay}
	// The principal scopes every key: it must be the account that the
	// server's authentication VERIFIED, never a value the client sets
	// freely (an "X-Account" header would let anyone who knows or guesses
	// a key read another account's stored payment). Here a fixed table of
	// bearer tokens stands in for real authentication (sessions, OAuth,
	// mTLS); a request with no or an unknown token is refused
	// (ErrPrincipalRefused: 401) and runs nothing, while an authentication
	// backend that fails would return its own error (503, which clients
	// retry). (A principal function that returned "" would get 401 too: the
	// middleware refuses a key without a principal unless the server opts
	// in to one shared anonymous scope with WithAnonymousKeys.)
	tokens := map[string]string{"tok_demo_acct_1": "acct_1", "tok_demo_acct_2": "acct_2"}
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if account := tokens[token]; ok && account != "" {
				return account, nil
			}
			return "", fmt.Errorf("no valid bearer token: %w", idempotency.ErrPrincipalRefused)
		}),
		idempotency.WithKeyRequired(true),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(a.pay)))
	return &app{db: db, proc: proc, handler: mux, close: func() {
		procSrv.Close()
		transport.CloseIdleConnections()
		_ = db.Close()
	}}, nil
}

// serve serves the payments API on ln until ctx ends, without faults, and
// with two accounts (bearer tokens tok_demo_acct_1 and tok_demo_acct_2), as
// a target for idemcheck; each payment waits delay first. It prints where
// it listens, and what the database holds when it stops.
func serve(ctx context.Context, ln net.Listener, w io.Writer, delay time.Duration) error {
	dir, err := os.MkdirTemp("", "saferetry-payments")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	app, err := newApp(ctx, dir, &printer{w: io.Discard}, 0, delay)
	if err != nil {
		return err
	}
	defer app.close()
	srv := &http.Server{Handler: app.handler, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(w, "payments: serving POST http://%s/payments "+
		"(Authorization: Bearer tok_demo_acct_1 or tok_demo_acct_2)\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	<-errc
	var orders int
	if err := app.db.QueryRowContext(shutdown, `SELECT COUNT(*) FROM orders`).Scan(&orders); err != nil {
		return err
	}
	app.proc.mu.Lock()
	charges := len(app.proc.charges)
	app.proc.mu.Unlock()
	fmt.Fprintf(w, "payments: stopped; %d orders, %d charges\n", orders, charges)
	return nil
}

// run sets everything up, pays order 42 once through the retrying client,
// prints what happened and returns it.
func run(ctx context.Context, w io.Writer) (result, error) {
	var res result
	out := &printer{w: w}
	dir, err := os.MkdirTemp("", "saferetry-payments")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	app, err := newApp(ctx, dir, out, 1, 0)
	if err != nil {
		return res, err
	}
	defer app.close()
	db, proc := app.db, app.proc
	flt := &faults{next: app.handler, out: out}
	apiSrv := httptest.NewServer(flt)
	defer apiSrv.Close()

	// The client: a saferetry Transport with an event-derived key, so that
	// even a client that crashed and restarted would send the same key for
	// paying order 42.
	// One connection per attempt: on a reused keep-alive connection,
	// net/http itself silently re-sends a request that carries an
	// Idempotency-Key when the connection breaks; the key makes that safe
	// too, but here every retry is the Transport's, and shown.
	clientTransport := &http.Transport{DisableKeepAlives: true}
	defer clientTransport.CloseIdleConnections()
	client := &http.Client{Transport: saferetry.NewTransport(clientTransport,
		saferetry.WithMaxAttempts(4),
		saferetry.WithBackoff(jitter.Config{Base: 20 * time.Millisecond}),
		saferetry.WithBudget(budget.NewRegistry(nil)),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))}
	key := keygen.Event("order-pay", "42")
	out.say("client: POST /payments for order 42 with Idempotency-Key %s", key)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, apiSrv.URL+"/payments",
		strings.NewReader(`{"order":"42","amount":4200}`))
	if err != nil {
		return res, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer tok_demo_acct_1")
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return res, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return res, err
	}
	res.status, res.body = resp.StatusCode, string(b)
	res.replayed = resp.Header.Get(idempotency.ReplayedHeader) == "true"
	res.serverRequests = int(flt.n.Load())
	out.say("client: got %d %s (Idempotent-Replayed: %v) after %d requests", res.status, res.body, res.replayed, res.serverRequests)

	// Someone else with the same key and a header naming the account, but
	// no valid token: refused, nothing replayed.
	out.say("")
	out.say("intruder: the same key, X-Account: acct_1, no valid token")
	forged, err := http.NewRequestWithContext(ctx, http.MethodPost, apiSrv.URL+"/payments",
		strings.NewReader(`{"order":"42","amount":4200}`))
	if err != nil {
		return res, err
	}
	forged.Header.Set("Content-Type", "application/json")
	forged.Header.Set("X-Account", "acct_1")
	forged.Header.Set("Authorization", "Bearer guessed")
	forged.Header.Set("Idempotency-Key", key)
	fresp, err := (&http.Client{Transport: clientTransport}).Do(forged)
	if err != nil {
		return res, err
	}
	_, _ = io.Copy(io.Discard, fresp.Body)
	fresp.Body.Close()
	res.forgedStatus = fresp.StatusCode
	out.say("intruder: got %d", res.forgedStatus)

	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&res.orders); err != nil {
		return res, err
	}
	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM receipts`).Scan(&res.receipts); err != nil {
		return res, err
	}
	proc.mu.Lock()
	res.charges, res.chargeCalls, res.lookups = len(proc.charges), proc.calls, proc.lookups
	for k := range proc.charges {
		res.keys = append(res.keys, k)
	}
	proc.mu.Unlock()
	out.say("")
	out.say("database: %d order, %d receipt; processor: %d charge from %d charge calls (1 while it was down) and %d lookup",
		res.orders, res.receipts, res.charges, res.chargeCalls, res.lookups)
	out.say("one logical payment, effectively once: the retries reused one key, the order phase ran once,")
	out.say("the charge was made once under its downstream key, and the lost answer was replayed.")
	return res, nil
}
