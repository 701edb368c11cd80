// Command chaos is saferetry's main demo: a payments API behind the
// idempotency middleware, an in-process toxiproxy and an HTTP fault layer
// injecting resets, timeouts, latency and 503/429 storms, and a fleet of
// saferetry clients sending payments through them with event-derived keys.
// At the end it counts the rows in the payments table and exits non-zero
// if any payment took effect twice or not at all.
//
//	go run ./examples/chaos
//	go run ./examples/chaos -duration 10s -clients 32 -faults 'calm=1,reset=2,5xx-after-commit=2'
//	go run ./examples/chaos -metrics metrics.json
//	go run ./examples/chaos -unsafe-no-idempotency # the contrast: duplicates, exit status 1
//	go run ./examples/chaos -store postgres -dsn postgres://postgres@127.0.0.1:5432/test?sslmode=disable
//	go run ./examples/chaos -store redis -dsn 127.0.0.1:6379
//	go run ./examples/chaos -store redis-cluster -dsn 127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
//	go run ./examples/chaos -store mysql -dsn 'root@tcp(127.0.0.1:3306)/test'
//
// Everything runs in one process on loopback; the PostgreSQL, MySQL and
// Redis stores need a server running (the demo starts none).
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"
)

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

// parseFlags reads the command line into a config. flag.ErrHelp is
// returned for -help.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	faults := fs.String("faults", defaultFaults, "fault mix (see below)")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "length of the chaos phase (the whole run takes a few seconds more)")
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "concurrent clients, each with its own connection pool and Transport")
	fs.StringVar(&cfg.Store, "store", cfg.Store, "idempotency store: memory, sqlite (a file in a temp dir), postgres, mysql (MySQL or MariaDB), redis or redis-cluster")
	fs.StringVar(&cfg.DSN, "dsn", "", "postgres: connection string (default $SAFERETRY_PG_DSN); mysql: go-sql-driver DSN (default $SAFERETRY_MYSQL_DSN); "+
		"sqlite: a database file path (default: a new temp dir); "+
		"redis: host:port (default $SAFERETRY_REDIS_ADDR, else 127.0.0.1:6379); redis-cluster: comma-separated addresses (default $SAFERETRY_REDIS_CLUSTER_ADDRS)")
	fs.DurationVar(&cfg.AttemptTimeout, "attempt-timeout", cfg.AttemptTimeout, "the clients' per-attempt timeout (saferetry.WithAttemptTimeout)")
	fs.IntVar(&cfg.MaxAttempts, "attempts", cfg.MaxAttempts, "attempts per logical request, first included (saferetry.WithMaxAttempts)")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of the fault schedule (0: random)")
	fs.BoolVar(&cfg.Verbose, "v", false, "print the server's warnings (store failures, lost leases) as they happen")
	fs.DurationVar(&cfg.Think, "think", cfg.Think, "mean pause between two logical requests of a client")
	fs.StringVar(&cfg.Metrics, "metrics", "", "write the run's OpenTelemetry metrics (client and server, otelsaferetry) to this file as JSON (stdout exporter)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the temporary SQLite file (or the PostgreSQL schema, or the MySQL database) after the run, to inspect it")
	fs.BoolVar(&cfg.Unsafe, "unsafe-no-idempotency", false, "the contrast: run without the "+
		"idempotency middleware, so that retries repeat payments (duplicates, exit 1)")
	fs.Usage = func() {
		out := fs.Output()
		fmt.Fprint(out, `Usage: go run ./examples/chaos [flags]

Runs a payments API behind the idempotency middleware and a fault-injecting
proxy, sends payments from a fleet of saferetry clients, re-sends what failed,
and checks that every payment had its effect effectively once within its key's
scope (at-least-once delivery plus de-duplication). Exit status: 0 pass,
1 duplicates or lost payments, 2 error. With -unsafe-no-idempotency, the same
run without the middleware shows what the guarantee prevents: payments whose
answer was lost are paid again, and it exits 1.

Flags:
`)
		fs.VisitAll(func(f *flag.Flag) {
			name, usage := flag.UnquoteUsage(f)
			if name != "" {
				name = " " + name // a boolean flag takes no value
			}
			fmt.Fprintf(out, "  -%s%s\n    \t%s", f.Name, name, usage)
			if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "false" {
				fmt.Fprintf(out, " (default %s)", f.DefValue)
			}
			fmt.Fprintln(out)
		})
		fmt.Fprintf(out, "\nFault mix: \"none\", or comma-separated kind=weight or kind=weight@share items.\n")
		fmt.Fprintf(out, "Time is cut into episodes (a fortieth of -duration each, 100..700 ms); each episode applies\n")
		fmt.Fprintf(out, "one kind, dealt from a shuffled deck holding every kind weight times. share is the fraction\n")
		fmt.Fprintf(out, "of connections (toxiproxy kinds) or requests (HTTP kinds) an episode hits. Kinds:\n")
		fmt.Fprint(out, faultHelp())
		fmt.Fprintf(out, "Default: %s\n", defaultFaults)
	}
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return cfg, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	mix, err := parseFaults(*faults)
	if err != nil {
		return cfg, err
	}
	cfg.Faults = mix
	if cfg.Store == "postgres" && cfg.DSN == "" {
		cfg.DSN = os.Getenv("SAFERETRY_PG_DSN")
	}
	if cfg.Store == "mysql" && cfg.DSN == "" {
		cfg.DSN = os.Getenv("SAFERETRY_MYSQL_DSN")
	}
	if cfg.Store == "redis" && cfg.DSN == "" {
		cfg.DSN = cmp.Or(os.Getenv("SAFERETRY_REDIS_ADDR"), "127.0.0.1:6379")
	}
	if cfg.Store == "redis-cluster" && cfg.DSN == "" {
		cfg.DSN = os.Getenv("SAFERETRY_REDIS_CLUSTER_ADDRS")
	}
	switch {
	case cfg.Store != "memory" && cfg.Store != "sqlite" && cfg.Store != "postgres" && cfg.Store != "mysql" &&
		cfg.Store != "redis" && cfg.Store != "redis-cluster":
		return cfg, fmt.Errorf("-store %q: want memory, sqlite, postgres, mysql, redis or redis-cluster", cfg.Store)
	case cfg.Duration <= 0 || cfg.Duration > time.Hour:
		return cfg, errors.New("-duration must be between 0 and 1h")
	case cfg.Clients <= 0 || cfg.Clients > 1000:
		return cfg, errors.New("-clients must be between 1 and 1000")
	case cfg.AttemptTimeout <= 0:
		return cfg, errors.New("-attempt-timeout must be positive")
	case cfg.MaxAttempts <= 0:
		return cfg, errors.New("-attempts must be positive")
	case cfg.Think < 0:
		return cfg, errors.New("-think must not be negative")
	}
	return cfg, nil
}

// realMain runs the demo and returns the exit status: 0 when every logical
// request had its effect effectively once within its key's scope, 1 when
// there were duplicates or lost requests, 2 on a usage or setup error.
func realMain(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "chaos:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	sum, err := run(ctx, cfg, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "chaos:", err)
		return 2
	}
	if sum.failed() {
		return 1
	}
	return 0
}
