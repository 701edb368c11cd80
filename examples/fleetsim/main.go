// Command fleetsim is a deterministic discrete-event simulation of retrying
// clients. It runs three experiments and prints their results as markdown
// tables, writing CSV files (and PNG plots, see below) to an output directory:
//
//  1. Marc Brooker's optimistic-concurrency contention experiment from
//     "Exponential Backoff And Jitter" (AWS Architecture Blog, 2015): N
//     clients read a versioned row and write it back with the version they
//     read; a write fails when the version moved; a failed client backs off
//     and starts over. It counts write calls and the time until the last
//     client succeeds, for no backoff, exponential backoff without jitter,
//     equal, full and decorrelated jitter (this module's jitter functions),
//     N = 10 to 190 step 10, averaged over 100 runs.
//  2. An outage: a fleet of client instances, each deciding its retries with
//     the Transport's own decision function (internal/decide.Decide, which
//     the saferetry Transport calls after every attempt, then the commit
//     step that takes a retry's cost, decide.Grant, and its budget
//     bookkeeping, decide.Begin and decide.End) and a budget of package
//     budget, on a simulated clock, against a server that answers
//     503 to everything for a while and then recovers:
//     the requests reaching the server per second, and the amplification,
//     without a budget, with the default token bucket and with the ratio
//     budget.
//  3. A chain of services (-chain runs it alone): a fleet of clients calls a
//     middle tier, which calls a second middle tier, which calls a bottom
//     tier that fails every request for a while, then half of them. Every
//     tier retries with the same decision function, up to 3 attempts, with
//     no budget or the default token bucket per instance, and with or
//     without pushback (a service whose call below gave up on a retryable
//     failure or was answered with the mark marks its failure "retried
//     below", and no caller retries a marked answer: internal/decide.PushBack,
//     as the Transport and deadline.Middleware do). It reports the bottom's requests per user
//     request over time, their peak and steady state, and the success rate
//     of the user requests in the 50% outage, beside one layer of clients
//     calling the bottom directly.
//
// Nothing sleeps: time is simulated, and every random draw comes from a
// stream seeded by -seed, so a run is reproducible.
//
// Usage:
//
//	go run ./examples/fleetsim [-runs 100] [-seed 1] [-out dir] [-chain]
//
// It writes occ.csv, outage.csv and chain.csv to -out (default: a new
// temporary directory). The PNG plots (occ-calls.png, occ-time.png,
// outage.png, chain.png) are drawn by plot.go with gonum.org/v1/plot.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

// writePlots renders the PNG plots; plot.go sets it. It is a variable so
// that the simulation stays separate from the drawing.
var writePlots func(dir string, occ []OCCRow, oc OutageConfig, outage []OutageResult) ([]string, error)

// writeChainPlot renders the chain experiment's plot; plot.go sets it.
var writeChainPlot func(dir string, c ChainConfig, rs []ChainResult) (string, error)

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

// usageError is a command line that fleetsim cannot run.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// realMain runs the command and returns its exit status: 0 on success and
// for -h or -help (the usage is what was asked for), 2 for a bad command
// line, 1 for any other error.
func realMain(args []string, stdout, stderr io.Writer) int {
	err := run(args, stdout, stderr)
	var usage usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &usage):
		fmt.Fprintln(stderr, "fleetsim:", err)
		return 2
	default:
		fmt.Fprintln(stderr, "fleetsim:", err)
		return 1
	}
}

const usage = `Usage: go run ./examples/fleetsim [flags]

Simulates retrying clients on a simulated clock, deterministically (a few
seconds; -chain under one): Brooker's contention experiment, a fleet in an
outage against one server, and a chain of services. It prints markdown
tables and writes CSV files and PNG plots.

Flags:
`

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fleetsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	runs := fs.Int("runs", 100, "runs averaged per contention level and strategy")
	seed := fs.Uint64("seed", 1, "seed of every random stream")
	out := fs.String("out", "", "output directory for CSV and PNG files (default: a new temporary directory)")
	chainOnly := fs.Bool("chain", false, "run only the chain experiment")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err}
	}
	if *runs < 1 {
		return usageError{fmt.Errorf("-runs must be at least 1, got %d", *runs)}
	}
	dir := *out
	if dir == "" {
		d, err := os.MkdirTemp("", "fleetsim-")
		if err != nil {
			return err
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}

	start := time.Now()
	var files []string
	if !*chainOnly {
		written, err := runContentionAndOutage(*seed, *runs, dir, stdout)
		if err != nil {
			return err
		}
		files = written
	}
	written, err := runChain(*seed, dir, stdout)
	if err != nil {
		return err
	}
	files = append(files, written...)
	fmt.Fprintf(stdout, "\nWrote %d files to %s in %v.\n", len(files), dir, time.Since(start).Round(time.Millisecond))
	return nil
}

// runContentionAndOutage runs the first two experiments, prints their
// tables and writes their files.
func runContentionAndOutage(seed uint64, runs int, dir string, stdout io.Writer) ([]string, error) {
	occCfg := DefaultOCCConfig(seed)
	occCfg.Runs = runs
	occ := RunOCC(occCfg)
	outCfg := DefaultOutageConfig(seed)
	outage := RunOutage(outCfg)

	fmt.Fprintf(stdout, "# fleetsim (seed %d, %d runs per point)\n\n", seed, runs)
	fmt.Fprintf(stdout, "## Contention: write calls per run (mean of %d runs)\n\n", runs)
	writeOCCTable(stdout, occ, func(r OCCRow, s int) string { return fmt.Sprintf("%.0f", r.Calls[s]) })
	fmt.Fprintf(stdout, "\n## Contention: time until the last client succeeds, ms (mean of %d runs)\n\n", runs)
	writeOCCTable(stdout, occ, func(r OCCRow, s int) string { return fmt.Sprintf("%.0f", ms(r.Time[s])) })
	if row, ok := rowAt(occ, 100); ok {
		fmt.Fprintf(stdout, "\n## Contention at %d clients\n\n", row.Clients)
		writeOCCSummary(stdout, row)
		fmt.Fprintln(stdout)
		for _, c := range CheckOCC(row) {
			fmt.Fprintln(stdout, "- "+c.String())
		}
	}
	fmt.Fprintf(stdout, "\n## Outage: %d clients x %.0f requests/s, server answers 503 from %v to %v\n\n",
		outCfg.Clients, outCfg.RatePerClient, outCfg.OutageStart, outCfg.OutageEnd)
	writeOutageTable(stdout, outCfg, outage)

	files, err := writeCSV(dir, occ, outage)
	if err != nil {
		return nil, err
	}
	if writePlots == nil {
		fmt.Fprintln(stdout, "\n(no plotter linked: PNG plots skipped)")
		return files, nil
	}
	pngs, err := writePlots(dir, occ, outCfg, outage)
	if err != nil {
		return nil, err
	}
	return append(files, pngs...), nil
}

// runChain runs the chain experiment, prints its table and writes its
// files.
func runChain(seed uint64, dir string, stdout io.Writer) ([]string, error) {
	c := DefaultChainConfig(seed)
	chain, oneLayer := RunChain(c), RunOneLayer(c)
	fmt.Fprintf(stdout, "\n## Chain: %d clients x %.0f requests/s -> %d middle tiers of %d instances -> bottom, "+
		"%d attempts per layer; the bottom fails every request from %v to %v, half of them to %v\n\n",
		c.Clients, c.RatePerClient, c.Middle, c.Instances, c.MaxAttempts, c.FullStart, c.HalfStart, c.HalfEnd)
	fmt.Fprintln(stdout, "Bottom requests per user request (peak: the worst second of arrivals in the outage;")
	fmt.Fprintf(stdout, "steady state and success rate: the user requests arriving in the %v that end %v before\n",
		c.Steady, c.Steady)
	fmt.Fprintln(stdout, "the phase does; one layer: the same clients calling the bottom directly).")
	fmt.Fprintln(stdout)
	writeChainTable(stdout, c, chain, oneLayer)
	path, err := writeChainCSV(dir, chain)
	if err != nil {
		return nil, err
	}
	files := []string{path}
	if writeChainPlot != nil {
		png, err := writeChainPlot(dir, c, chain)
		if err != nil {
			return nil, err
		}
		files = append(files, png)
	}
	return files, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func rowAt(rows []OCCRow, n int) (OCCRow, bool) {
	for _, r := range rows {
		if r.Clients == n {
			return r, true
		}
	}
	return OCCRow{}, false
}
