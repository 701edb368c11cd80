// Command idemcheck checks that an HTTP endpoint honours the Idempotency-Key
// header: that a client's retries of one write take effect effectively once.
// It sends the request under fresh keys and reports each check of package
// idemcheck (replay, concurrent, in_progress, mismatch, scope, invalid_key,
// marker) with its evidence, and for each failure what a retrying client
// would suffer.
//
//	idemcheck [flags] URL
//
// Run it with -h for the flags. Each check's verdict is printed as the
// check finishes: PASS, FAIL, SKIP (unverified: the check could not tell)
// or INFO (what the target chose where the contract leaves a choice, for a
// person to judge). Exit status: 0 when no check failed, 1 when one
// failed, 2 when the target could not be checked (unreachable, or its
// first answer is not a success) or the command line is wrong. The error
// goes to stderr; with -json, stdout holds the report all the same, with
// the checks that ran (maybe none) and the error in its "error" member,
// and the verdicts go to stderr as they come.
//
// Its client sends each request once. A Go client of your own does not:
// net/http sends a POST that carries an Idempotency-Key again by itself,
// once and silently, when the kept-alive connection it rode dies before
// the answer, and against a provider that ignores keys that is a second
// charge no log shows. The saferetry Transport refuses that re-send for a
// request with a body and counts it as an attempt for a bodyless one; a
// plain http.Client does neither (see package idemcheck).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/internal/wait"
)

// maxBodyFile bounds the body read by -d @file.
const maxBodyFile = 10 << 20

const usage = `usage: idemcheck [flags] URL

Checks that the endpoint at URL honours the Idempotency-Key header. It sends
the request (-X, -d, -H) under fresh keys, 13 times plus -n (up to 2n more
when the first burst of -n sees no conflict, up to 3 retries after a
conflict, 3 more when malformed keys are accepted, one more for each
transient 502, 503 or 504, which is sent again once), and reports the checks
replay, concurrent, in_progress, mismatch, scope, invalid_key and marker.
The request must succeed under a fresh key every time, and the run creates
seven effects (up to twelve): point it at a sandbox or staging API.

Each check's verdict is printed as the check finishes:
  PASS  the target did what a retrying client needs;
  FAIL  it did something that harms a retrying client, which answers lost
        on the way cannot explain (a transient or lost answer is sent
        again with the same key and judged allowing for a replay): the
        line says what;
  SKIP  unverified: the check could not run (no -other), or what it saw is
        no evidence either way (answers that do not identify their effect,
        or only echo what the request sent: set -id-field);
  INFO  neither: what the target chose where the contract leaves a choice
        (in_progress: the conflict's status and Retry-After; marker: the
        replay header and the key forms accepted; invalid_key: a malformed
        key accepted but de-duplicated; scope: keys shared by principals),
        for a person to judge.

Exit status: 0 when no check failed, 1 when one failed, 2 when the target
could not be checked (unreachable, or its first answer is not a 2xx) or the
command line is wrong; the error goes to stderr, and with -json stdout
holds the report all the same, with the checks that ran (maybe none) and
the error in its "error" member, and the verdicts go to stderr.

Example:
  idemcheck -H 'Authorization: Bearer tok_1' -H 'Content-Type: application/json' \
    -other 'Authorization: Bearer tok_2' -id-field id -d '{"amount":100}' \
    https://staging.example.com/v1/payments

Flags:
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run is the command: it parses args, checks the target and prints the
// report on stdout and errors on stderr; it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	var out bytes.Buffer
	fs := flag.NewFlagSet("idemcheck", flag.ContinueOnError)
	fs.SetOutput(&out)
	var cfg idemcheck.Config
	var header, other headerFlag
	fs.StringVar(&cfg.Method, "X", http.MethodPost, "the request's `method`")
	data := fs.String("d", "", "the request `body`, sent as given; @file reads it from a file")
	fs.Var(&header, "H", "a header of the caller, `'Name: value'`, such as Authorization and\n"+
		"Content-Type (repeatable)")
	fs.Var(&other, "other", "a header of a second principal, `'Name: value'`, such as another\n"+
		"Authorization (repeatable); it replaces the same -H header and runs the scope check")
	fs.StringVar(&cfg.IDField, "id-field", "", "the JSON `member` of a success answer that "+
		"identifies the effect\nit created (a.b reaches into objects); without it effects are "+
		"told apart by their bodies,\nand a body that varies by answer (a timestamp) makes a "+
		"replay look like a new effect")
	fs.IntVar(&cfg.N, "n", 0, "concurrent duplicates, at most 256 (0: 8)")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	fs.StringVar(&cfg.KeyHeader, "key-header", "",
		"the `header` that carries the key (empty: Idempotency-Key)")
	fs.DurationVar(&cfg.Timeout, "timeout", 0,
		"bound on each request, its answer included (0: 10s)")
	maxTime := fs.Duration("max-time", 2*time.Minute, "bound on the whole run")
	wait := fs.Duration("wait", 0, "wait up to this long for the target to accept connections\n"+
		"(a server starting in the background); 0 checks at once")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			_, _ = out.WriteTo(stdout)
			return 0
		}
		_, _ = out.WriteTo(stderr)
		return 2
	}
	// report prints the end of the report: the summary line, or with
	// -json the whole report (and err, if the run could not finish).
	report := func(rep idemcheck.Report, err error) {
		if !*asJSON {
			if len(rep.Checks) > 0 {
				fmt.Fprintln(stdout, rep.Summary())
			}
			return
		}
		out := jsonReport{Report: rep}
		if out.Target == "" {
			out.Target = cfg.URL
		}
		if out.Checks == nil {
			out.Checks = []idemcheck.Check{} // JSON: a list, never null
		}
		if err != nil {
			out.Error = err.Error()
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(out)
	}
	// fail reports an error that stops the run: on stderr, and with -json
	// in the report so far (maybe no check) on stdout, which stays JSON.
	fail := func(rep idemcheck.Report, err error) int {
		report(rep, err)
		fmt.Fprintln(stderr, err)
		return 2
	}
	var none idemcheck.Report
	if fs.NArg() != 1 {
		return fail(none, errors.New("idemcheck: give one URL (idemcheck -h for help)"))
	}
	cfg.URL = fs.Arg(0)
	cfg.Header, cfg.Other = header.h, other.h
	if *maxTime <= 0 {
		return fail(none, errors.New("idemcheck: -max-time must be positive"))
	}
	body, err := readBody(*data)
	if err != nil {
		return fail(none, err)
	}
	cfg.Body = body
	// Each verdict as its check finishes: the whole check on stdout, or
	// with -json its line on stderr (stdout holds the JSON).
	heading := false
	cfg.OnCheck = func(c idemcheck.Check) {
		if *asJSON {
			line, _, _ := strings.Cut(c.String(), "\n")
			fmt.Fprintln(stderr, line)
			return
		}
		if !heading {
			heading = true
			fmt.Fprintf(stdout, "idemcheck %s\n", cfg.URL)
		}
		fmt.Fprint(stdout, c.String())
	}

	ctx, cancel := context.WithTimeout(context.Background(), *maxTime)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt)
	defer stop()
	if *wait > 0 {
		if err := waitFor(ctx, cfg.URL, *wait); err != nil {
			return fail(none, err)
		}
	}
	rep, err := idemcheck.Run(ctx, cfg)
	switch {
	case err != nil:
		return fail(rep, err)
	case rep.Failed():
		report(rep, nil)
		return 1
	}
	report(rep, nil)
	return 0
}

// jsonReport is the report as -json prints it: the package's, plus the
// error that stopped the run ("error", absent when the run finished).
type jsonReport struct {
	idemcheck.Report
	Error string `json:"error,omitempty"`
}

// readBody returns the -d value, or the file it names after '@' (at most
// maxBodyFile bytes).
func readBody(d string) ([]byte, error) {
	name, ok := strings.CutPrefix(d, "@")
	if !ok {
		return []byte(d), nil
	}
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("idemcheck: -d: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxBodyFile+1))
	if err != nil {
		return nil, fmt.Errorf("idemcheck: -d: %w", err)
	}
	if len(b) > maxBodyFile {
		return nil, fmt.Errorf("idemcheck: -d: %s is larger than %d bytes", name, maxBodyFile)
	}
	return b, nil
}

// waitFor waits until the host of rawURL accepts a TCP connection, trying
// every 100 ms for at most d.
func waitFor(ctx context.Context, rawURL string, d time.Duration) error {
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" {
		return fmt.Errorf("idemcheck: bad URL %q", rawURL)
	}
	addr := u.Host
	if u.Port() == "" {
		port := "80"
		if u.Scheme == "https" {
			port = "443"
		}
		addr = net.JoinHostPort(u.Hostname(), port)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var dialer net.Dialer
	for {
		conn, err := dialer.DialContext(ctx, "tcp", addr)
		if err == nil {
			return conn.Close()
		}
		if wait.Sleep(ctx, 100*time.Millisecond) != nil {
			return fmt.Errorf("idemcheck: nothing accepted connections at %s within %v (-wait): %w",
				addr, d, err)
		}
	}
}

// headerFlag collects repeated 'Name: value' flags.
type headerFlag struct{ h http.Header }

func (f *headerFlag) String() string {
	if f == nil || f.h == nil {
		return ""
	}
	var b strings.Builder
	_ = f.h.Write(&b)
	return strings.TrimSpace(b.String())
}

func (f *headerFlag) Set(s string) error {
	name, value, err := parseHeader(s)
	if err != nil {
		return err
	}
	if f.h == nil {
		f.h = http.Header{}
	}
	f.h.Add(name, value)
	return nil
}

// parseHeader splits "Name: value" at its first colon and trims the spaces
// and tabs around both parts. The name must not be empty; Run checks that
// name and value can be sent.
func parseHeader(s string) (name, value string, err error) {
	name, value, ok := strings.Cut(s, ":")
	name = strings.Trim(name, " \t")
	if !ok || name == "" {
		return "", "", fmt.Errorf("want 'Name: value', got %q", s)
	}
	return name, strings.Trim(value, " \t"), nil
}
