// Command eventkeys shows why an event-derived idempotency key is the best
// kind: it survives a process restart. A process sends an order
// confirmation and crashes before it records the answer; its replacement
// derives the same key from the same event (keygen.Event), and the server,
// which honours keys (package idempotency, memory store), replays the stored
// answer instead of sending a second e-mail. The same story with a random
// key per process sends two. Loopback only.
//
//	go run ./examples/eventkeys
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

func main() {
	if err := parseFlags(os.Args[1:], os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	if _, err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "eventkeys:", err)
		os.Exit(1)
	}
}

const usage = `Usage: go run ./examples/eventkeys

Shows why an event-derived idempotency key (keygen.Event) is the best kind:
a process sends an order confirmation and crashes before it records the
answer; its replacement derives the same key from the same event, and the
server (package idempotency, memory store, loopback only) replays the stored
answer instead of sending a second e-mail. With a random key per process,
two e-mails go out.
`

// parseFlags reads the command line, which takes no flag but -h: it
// returns flag.ErrHelp after writing the usage to w for -h, and an error
// for anything else.
func parseFlags(args []string, w io.Writer) error {
	fs := flag.NewFlagSet("eventkeys", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() { fmt.Fprint(w, usage) }
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return nil
}

// report is what happened, for the test.
type report struct {
	eventKey, randomKeys []string // the key each process sent
	eventEmails          int64    // e-mails sent for the order with an event-derived key
	randomEmails         int64    // e-mails sent for the order with random keys
	eventReplayed        bool     // the restarted process got the stored answer
	sameConfirmation     bool     // ... with the confirmation id of the first execution
	collisionSafe        bool     // Event("a-b","c") != Event("a","b-c")
}

// mailer is the side effect: one e-mail per execution, counted per order.
type mailer struct {
	sent map[string]*atomic.Int64
	next atomic.Int64
}

func (m *mailer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Order string `json:"order"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || m.sent[req.Order] == nil {
		http.Error(w, "unknown order", http.StatusBadRequest)
		return
	}
	m.sent[req.Order].Add(1) // "send the e-mail"
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"confirmation":"c-%d","order":%q}`+"\n", m.next.Add(1), req.Order)
}

// process is one run of the client program: its own Transport, budget and
// connections, nothing kept from a previous run.
type process struct {
	name   string
	client *http.Client
}

func newProcess(name string) *process {
	return &process{name: name, client: saferetry.NewClient(
		saferetry.WithBudget(budget.NewRegistry(nil)),
		saferetry.WithLogger(slog.New(slog.DiscardHandler)))}
}

// confirm sends the confirmation of order; key "" lets the Transport attach
// a random key of its own.
func (p *process) confirm(ctx context.Context, url, order, key string) (status int, replayed bool, body, sentKey string, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"order":"`+order+`"}`))
	if err != nil {
		return 0, false, "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	// The same credentials on every attempt: the key's scope includes the
	// caller (here the middleware's default principal, from Authorization).
	req.Header.Set("Authorization", "Bearer shop-7")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return 0, false, "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, false, "", "", err
	}
	// The key that went out is on the request the response carries.
	return resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader) == "true",
		strings.TrimSpace(string(b)), resp.Request.Header.Get("Idempotency-Key"), nil
}

func run(ctx context.Context, w io.Writer) (report, error) {
	var rep report
	m := &mailer{sent: map[string]*atomic.Int64{"42": {}, "43": {}}}
	mw := idempotency.New(memstore.New())
	mux := http.NewServeMux()
	mux.Handle("POST /confirmations", mw.Wrap(m))
	ts := httptest.NewServer(mux)
	defer ts.Close()
	url := ts.URL + "/confirmations"

	fmt.Fprintln(w, "Order 42, event-derived key keygen.Event(\"order-confirm\", \"42\"):")
	var first string
	for i, name := range []string{"process A", "process B (restarted)"} {
		p := newProcess(name)
		key := keygen.Event("order-confirm", "42") // derived from the event, not remembered
		status, replayed, body, sent, err := p.confirm(ctx, url, "42", key)
		if err != nil {
			return rep, err
		}
		rep.eventKey = append(rep.eventKey, sent)
		fmt.Fprintf(w, "  %-22s key %-16s -> %d replayed=%-5v %s\n", p.name, sent, status, replayed, body)
		if i == 0 {
			first = body
			fmt.Fprintln(w, "  process A crashes before it records the answer; B starts from the same event")
		} else {
			rep.eventReplayed = replayed
			rep.sameConfirmation = body == first
		}
	}
	rep.eventEmails = m.sent["42"].Load()
	fmt.Fprintf(w, "  e-mails sent for order 42: %d\n\n", rep.eventEmails)

	fmt.Fprintln(w, "Order 43, a random key per process (what the Transport attaches when given none):")
	for _, name := range []string{"process A", "process B (restarted)"} {
		p := newProcess(name)
		status, replayed, body, sent, err := p.confirm(ctx, url, "43", "")
		if err != nil {
			return rep, err
		}
		rep.randomKeys = append(rep.randomKeys, sent)
		fmt.Fprintf(w, "  %-22s key %s -> %d replayed=%-5v %s\n", p.name, sent, status, replayed, body)
	}
	rep.randomEmails = m.sent["43"].Load()
	fmt.Fprintf(w, "  e-mails sent for order 43: %d (the restart forgot the key: a new request)\n\n", rep.randomEmails)

	a, b := keygen.Event("a-b", "c"), keygen.Event("a", "b-c")
	rep.collisionSafe = a != b
	fmt.Fprintf(w, "Joining rule: Event(\"a-b\", \"c\") = %s, Event(\"a\", \"b-c\") = %s: different events, different keys.\n", a, b)
	return rep, nil
}
