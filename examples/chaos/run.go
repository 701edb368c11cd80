package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
)

// config is what the flags set.
type config struct {
	Duration       time.Duration // length of the chaos phase
	Clients        int           // concurrent clients
	Faults         faultMix
	Store          string // "sqlite" or "postgres"
	DSN            string // PostgreSQL DSN, or a SQLite file path ("" = temp dir)
	AttemptTimeout time.Duration
	MaxAttempts    int
	Seed           uint64 // fault schedule seed; 0 = random
	Think          time.Duration
	Unsafe         bool   // run without the idempotency middleware (proves the check can fail)
	Verbose        bool   // print the server's warnings
	Keep           bool   // keep the temporary SQLite file or the PostgreSQL schema after the run
	Metrics        string // write the run's OpenTelemetry metrics to this file ("" = none)
}

func defaultConfig() config {
	mix, err := parseFaults(defaultFaults)
	if err != nil {
		panic(err) // the constant is tested
	}
	return config{
		Duration:       28 * time.Second,
		Clients:        16,
		Faults:         mix,
		Store:          "sqlite",
		AttemptTimeout: 300 * time.Millisecond,
		MaxAttempts:    3, // the Transport's default
		Think:          10 * time.Millisecond,
	}
}

// summary is the outcome of a run: what the table prints.
type summary struct {
	Store   string
	Where   string
	Unsafe  bool
	Seed    uint64
	Elapsed time.Duration

	Logical       int64 // logical requests issued in the chaos phase
	SucceededLive int64 // of which the client saw a 2xx during the chaos phase
	Attempts      int64 // client-side attempts (Transport records) in the chaos phase
	Retries       int64
	BudgetDenials int64
	InProgress    int64 // 409 in-progress answers seen by clients
	Replays       int64 // answers the server replayed (some were lost on the way back)
	ReplaysSeen   int64 // final answers clients received with Idempotent-Replayed: true
	ServerHits    int64 // requests that reached the server's HTTP layer (chaos phase)
	Executed      int64 // fresh executions answered by the handler (chaos + reconciliation)

	Reconciled      int64 // logical requests re-sent after the chaos phase
	ReconReplayed   int64 // of which answered from the store (they had taken effect)
	ReconExecuted   int64 // of which executed for the first time
	ReconFailed     int64 // of which still failed
	ReconConflicts  int64 // in-progress 409s met while reconciling
	SideEffects     int64 // rows in the payments table
	Duplicates      int64 // rows beyond one per key
	Lost            int64 // logical requests without a side effect after reconciliation
	PhantomSuccess  int64 // successes a client saw with no side effect behind them (part of Lost)
	WrongAnswers    int64 // successes whose payment id is not the key's row
	StrayRows       int64 // rows whose key no logical request used
	Amplification   float64
	Outcomes        string // per-attempt outcomes
	Injected        map[faultKind]int64
	ServerWarnings  int64
	ServerLastError string
	FailReasons     []string // why some logical requests still failed after reconciliation (a sample)
}

// failed reports whether the guarantee was broken.
func (s summary) failed() bool {
	return s.Duplicates != 0 || s.Lost != 0 || s.WrongAnswers != 0 || s.StrayRows != 0
}

// run is the whole demo: start the service behind a fault-injecting proxy,
// run the fleet for cfg.Duration, reconcile, count side effects, print the
// table to stdout (progress goes to stderr). The error is for setup failures
// and cancellation; a broken guarantee is reported in the summary.
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) (summary, error) {
	start := time.Now()
	sum := summary{Store: cfg.Store, Unsafe: cfg.Unsafe}
	if cfg.Duration <= 0 || cfg.Clients <= 0 || cfg.AttemptTimeout <= 0 || cfg.MaxAttempts <= 0 || len(cfg.Faults) == 0 {
		return sum, errors.New("invalid configuration: duration, clients, attempt timeout, attempts and faults must be positive")
	}
	seed := cfg.Seed
	if seed == 0 {
		seed = rand.Uint64()
	}
	sum.Seed = seed

	be, err := openBackend(ctx, cfg.Store, cfg.DSN, cfg.Keep)
	if err != nil {
		return sum, fmt.Errorf("opening the %s store: %w", cfg.Store, err)
	}
	defer be.close()
	sum.Where = be.where

	// The run's OpenTelemetry metrics, when asked for.
	met, err := newMetrics(cfg.Metrics)
	if err != nil {
		return sum, err
	}
	defer met.close(stderr)

	// The service.
	serverLog := newLevelCounter(cfg.Verbose, stderr)
	layer := newFaultLayer(cfg.AttemptTimeout * 3 / 2)
	a := newAPI(be)
	srv := &http.Server{
		Handler:           a.handler(layer, cfg.Unsafe, slog.New(serverLog), met.server),
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          log.New(io.Discard, "", 0),
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return sum, err
	}
	serveDone := make(chan struct{})
	go func() {
		defer close(serveDone)
		_ = srv.Serve(ln)
	}()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			_ = srv.Close()
		}
		<-serveDone
	}()

	// The network between the fleet and the service.
	tp := newToxiproxyServer()
	proxy := toxiproxy.NewProxy(tp, "payments", "127.0.0.1:0", ln.Addr().String())
	if err := proxy.Start(); err != nil {
		return sum, fmt.Errorf("starting toxiproxy: %w", err)
	}
	defer proxy.Stop()
	tx := &toxics{proxy: proxy, attemptTimeout: cfg.AttemptTimeout}

	// The fleet.
	counter := newAttemptCounter()
	fl := &fleet{
		url:     "http://" + proxy.Listen + "/payments",
		clients: cfg.Clients,
		think:   cfg.Think,
		opts: append([]saferetry.Option{
			saferetry.WithMaxAttempts(cfg.MaxAttempts),
			saferetry.WithAttemptTimeout(cfg.AttemptTimeout),
			saferetry.WithMaxElapsed(5 * time.Second),
			saferetry.WithBudget(budget.NewRegistry(nil)),
			saferetry.WithLogger(slog.New(counter)),
		}, met.client...),
	}
	defer fl.closeIdle()

	// Chaos phase: faults, fleet and progress line run together.
	chaosCtx, endChaos := context.WithTimeout(ctx, cfg.Duration)
	defer endChaos()
	var current atomic.Pointer[mixEntry]
	schedCtx, stopSched := context.WithCancel(ctx)
	schedErr := make(chan error, 1)
	go func() {
		rnd := rand.New(rand.NewPCG(seed, seed^0x5eed))
		schedErr <- runSchedule(schedCtx, newSchedule(cfg.Faults, rnd), episodeLength(cfg.Duration), rnd, tx, layer, &current)
	}()
	prog := startProgress(stderr, func(final bool) string {
		phase := "calm"
		if e := current.Load(); e != nil {
			phase = string(e.kind)
		}
		el := time.Since(start).Truncate(100 * time.Millisecond)
		return fmt.Sprintf("%5.1fs/%v %-16s logical %5d ok %5d  attempts %5d retries %4d denied %3d  replays %4d",
			el.Seconds(), cfg.Duration, phase, fl.done.Load(), fl.succeeded.Load(),
			counter.attempts.Load(), counter.retries.Load(), counter.denials.Load(), layer.replays.Load())
	})
	fl.run(ctx, chaosCtx)
	stopSched()
	serr := <-schedErr
	prog.stop()
	if ctx.Err() != nil {
		return sum, ctx.Err()
	}
	if serr != nil {
		return sum, serr
	}

	sum.Logical = int64(len(fl.logicals))
	sum.SucceededLive = fl.succeeded.Load()
	sum.Attempts = counter.attempts.Load()
	sum.Retries = counter.retries.Load()
	sum.BudgetDenials = counter.denials.Load()
	sum.InProgress = counter.inProgress.Load()
	sum.ServerHits = layer.requests.Load()
	sum.Outcomes = counter.outcomeSummary()
	sum.Injected = layer.injectedCounts()
	for _, l := range fl.logicals {
		if l.ok && l.replayed {
			sum.ReplaysSeen++
		}
	}
	if sum.Logical > 0 {
		sum.Amplification = float64(sum.Attempts) / float64(sum.Logical)
	}

	// Faults are off. Executions still running on the server (a stalled
	// handler whose client gave up) finish before reconciliation starts.
	if err := waitIdle(ctx, layer, 15*time.Second); err != nil {
		return sum, err
	}

	// Reconciliation: what a real client's dead-letter replay does. Every
	// logical request that did not end in a 2xx is re-sent with the SAME key,
	// straight to the service (no faults), until it gets a definitive answer.
	if err := reconcile(ctx, "http://"+ln.Addr().String()+"/payments", fl.logicals, serverLease+10*time.Second, &sum); err != nil {
		return sum, err
	}
	if err := waitIdle(ctx, layer, 15*time.Second); err != nil {
		return sum, err
	}
	sum.Replays = layer.replays.Load()
	sum.Executed = layer.executed.Load()
	sum.ServerWarnings, sum.ServerLastError = serverLog.warnings()

	// The verdict, from the business table itself.
	rows, err := be.sideEffects(ctx)
	if err != nil {
		return sum, fmt.Errorf("counting side effects: %w", err)
	}
	verify(fl.logicals, rows, &sum)
	sum.Elapsed = time.Since(start)
	printTable(stdout, cfg, sum)
	return sum, nil
}

// waitIdle waits until no request is being served.
func waitIdle(ctx context.Context, layer *faultLayer, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for layer.inflight.Load() > 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("the server still has %d requests in flight after %v", layer.inflight.Load(), limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// reconcile is what a real client's dead-letter replay does: every logical
// request that did not end in a 2xx is re-sent with the SAME key, straight to
// the service (no faults), through a clean client (unlimited budget), again
// and again until it gets a definitive answer or patience runs out. Patience
// is longer than the server's lease, so a record left in progress by an
// execution that never finished can be taken over.
func reconcile(ctx context.Context, url string, ls []*logical, patience time.Duration, sum *summary) error {
	var todo []*logical
	for _, l := range ls {
		if !l.ok {
			todo = append(todo, l)
		}
	}
	sum.Reconciled = int64(len(todo))
	if len(todo) == 0 {
		return nil
	}
	base := newBaseTransport()
	defer base.CloseIdleConnections()
	counter := newAttemptCounter()
	client := &http.Client{Transport: saferetry.NewTransport(base,
		saferetry.WithMaxAttempts(5),
		saferetry.WithAttemptTimeout(5*time.Second),
		saferetry.WithBudget(budget.Unlimited()),
		saferetry.WithLogger(slog.New(counter)))}
	giveUp := time.Now().Add(patience)
	work := make(chan *logical)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for l := range work {
				l.reconciled = true
				for {
					r := send(ctx, client, url, l)
					l.reconOK, l.reconReplayed = r.ok, r.replayed
					if r.ok {
						l.paymentID = r.paymentID
						break
					}
					l.lastErr = r.err
					if r.definitive || ctx.Err() != nil || time.Now().After(giveUp) {
						break
					}
					sleepCtx(ctx, time.Second)
				}
			}
		}()
	}
	for _, l := range todo {
		work <- l
	}
	close(work)
	wg.Wait()
	sum.ReconConflicts = counter.inProgress.Load()
	for _, l := range todo {
		switch {
		case !l.reconOK:
			sum.ReconFailed++
			if len(sum.FailReasons) < 3 {
				sum.FailReasons = append(sum.FailReasons, l.key+": "+l.lastErr)
			}
		case l.reconReplayed:
			sum.ReconReplayed++
		default:
			sum.ReconExecuted++
		}
	}
	return ctx.Err()
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// verify compares what the clients saw with the payments table.
//
//   - duplicates: rows beyond one per key;
//   - lost: logical requests whose key has no row after reconciliation; this
//     includes every success a client saw with no row behind it (phantom
//     successes, also shown on their own);
//   - wrong answers: successes whose payment id is not one of the key's rows;
//   - stray rows: rows under a key no logical request used.
func verify(ls []*logical, rows map[string][]int64, sum *summary) {
	keys := make(map[string]bool, len(ls))
	for _, l := range ls {
		keys[l.key] = true
		ids := rows[l.key]
		if len(ids) == 0 {
			sum.Lost++
			if l.ok || l.reconOK {
				sum.PhantomSuccess++
			}
			continue
		}
		if l.ok || l.reconOK {
			match := false
			for _, id := range ids {
				match = match || id == l.paymentID
			}
			if !match {
				sum.WrongAnswers++
			}
		}
	}
	for key, ids := range rows {
		sum.SideEffects += int64(len(ids))
		if len(ids) > 1 {
			sum.Duplicates += int64(len(ids) - 1)
		}
		if !keys[key] {
			sum.StrayRows += int64(len(ids))
		}
	}
}
