package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"
)

// progress prints a live status line: rewritten in place (\r) on a
// terminal, a plain line every few seconds otherwise.
type progress struct {
	stopc chan struct{}
	done  chan struct{}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func startProgress(w io.Writer, line func(final bool) string) *progress {
	p := &progress{stopc: make(chan struct{}), done: make(chan struct{})}
	tty := isTerminal(w)
	every := 2 * time.Second
	if tty {
		every = 200 * time.Millisecond
	}
	go func() {
		defer close(p.done)
		t := time.NewTicker(every)
		defer t.Stop()
		width := 0
		for {
			select {
			case <-p.stopc:
				if tty {
					s := line(true)
					fmt.Fprintf(w, "\r%-*s\n", width, s)
				} else {
					fmt.Fprintln(w, line(true))
				}
				return
			case <-t.C:
				s := line(false)
				if tty {
					width = max(width, len(s))
					fmt.Fprintf(w, "\r%-*s", width, s)
				} else {
					fmt.Fprintln(w, s)
				}
			}
		}
	}()
	return p
}

func (p *progress) stop() {
	close(p.stopc)
	<-p.done
}

// levelCounter is the server's slog.Handler: it counts warnings and errors
// (store failures, lost leases) and prints them only when verbose.
type levelCounter struct {
	verbose bool
	out     slog.Handler
	n       atomic.Int64
	mu      sync.Mutex
	last    string
}

func newLevelCounter(verbose bool, w io.Writer) *levelCounter {
	return &levelCounter{verbose: verbose, out: slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn})}
}

func (h *levelCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (h *levelCounter) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h *levelCounter) WithGroup(string) slog.Handler                { return h }

func (h *levelCounter) Handle(ctx context.Context, r slog.Record) error {
	h.n.Add(1)
	msg := r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "err" {
			msg += ": " + a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	h.last = msg
	h.mu.Unlock()
	if h.verbose {
		return h.out.Handle(ctx, r)
	}
	return nil
}

func (h *levelCounter) warnings() (int64, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n.Load(), h.last
}

// printTable writes the final report.
func printTable(w io.Writer, cfg config, s summary) {
	mode := "idempotency middleware ON"
	if s.Unsafe {
		mode = "idempotency middleware OFF (-unsafe-no-idempotency)"
	}
	fmt.Fprintf(w, "\nsaferetry chaos: %v of faults, %d clients, store %s (%s), %s\n", cfg.Duration, cfg.Clients, s.Store, s.Where, mode)
	fmt.Fprintf(w, "fault mix %s, seed %d\n\n", cfg.Faults, s.Seed)

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, v any, note string) {
		fmt.Fprintf(tw, "  %s\t%v\t  %s\n", name, v, note)
	}
	row("logical requests", s.Logical, fmt.Sprintf("one payment and one event-derived key each; %d succeeded during the chaos", s.SucceededLive))
	row("attempts", s.Attempts, fmt.Sprintf("client-side, from the Transport's records (%d requests reached the server*)", s.ServerHits))
	row("retries", s.Retries, "attempts the Transport retried")
	row("budget denials", s.BudgetDenials, "retries the shared token bucket refused")
	row("in-progress conflicts", s.InProgress, "409 idempotency_request_in_progress seen by clients")
	row("replays", s.Replays, fmt.Sprintf("stored answers replayed by the server (%d reached a client as its final answer in the chaos)", s.ReplaysSeen))
	row("side effects executed", s.SideEffects, "rows in the payments table")
	row("duplicates", s.Duplicates, "rows beyond one per key")
	row("lost requests", s.Lost, fmt.Sprintf("logical requests with no row after reconciliation (%d of them had been told success)", s.PhantomSuccess))
	row("amplification", fmt.Sprintf("%.2fx", s.Amplification), "attempts per logical request")
	_ = tw.Flush()

	fmt.Fprintf(w, "\n  reconciliation: %d logical requests had not succeeded; re-sent with the same key, no faults,\n", s.Reconciled)
	fmt.Fprintf(w, "  until a definitive answer (for at most %v, longer than the server's %v lease):\n", serverLease+10*time.Second, serverLease)
	fmt.Fprintf(w, "    %d answered from the store (they had taken effect), %d executed now, %d still failed\n", s.ReconReplayed, s.ReconExecuted, s.ReconFailed)
	if s.ReconConflicts > 0 {
		fmt.Fprintf(w, "    %d in-progress conflicts met on the way: records still claimed by an execution that never finished\n", s.ReconConflicts)
	}
	for _, r := range s.FailReasons {
		fmt.Fprintf(w, "      still failing: %s\n", r)
	}
	fmt.Fprintf(w, "  attempt outcomes: %s\n", s.Outcomes)
	fmt.Fprintf(w, "  * requests reset on their way out never reach the server; every request that does is an attempt\n")
	fmt.Fprintf(w, "    counted above (net/http's own re-sends included: the Transport refuses them for a payment,\n")
	fmt.Fprintf(w, "    which has a body, and would count them for a bodyless request).\n")
	fmt.Fprintf(w, "  faults injected into requests by the HTTP layer: %s\n", injectedSummary(s.Injected))
	if s.WrongAnswers != 0 || s.StrayRows != 0 {
		fmt.Fprintf(w, "  WRONG: %d successes carried a payment id that is not their key's row; %d rows under unknown keys\n", s.WrongAnswers, s.StrayRows)
	}
	if s.ServerWarnings != 0 {
		fmt.Fprintf(w, "  server warnings: %d (last: %s; -v prints them)\n", s.ServerWarnings, s.ServerLastError)
	}
	fmt.Fprintf(w, "  wall time: %v\n\n", s.Elapsed.Round(100*time.Millisecond))
	if s.failed() {
		fmt.Fprintf(w, "FAIL: %d duplicates, %d lost: the guarantee does not hold", s.Duplicates, s.Lost)
		if s.Unsafe {
			fmt.Fprint(w, " (as expected without the middleware: retries without de-duplication repeat the write)")
		}
		fmt.Fprintln(w)
		return
	}
	fmt.Fprintln(w, "PASS: every logical request took effect once (effectively once: at-least-once delivery plus")
	fmt.Fprintln(w, "de-duplication by key, within the key scope and the replay window).")
}

func injectedSummary(m map[faultKind]int64) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, string(k))
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[faultKind(k)]))
	}
	return strings.Join(parts, ", ") + " (toxiproxy faults hit connections and are not counted per request)"
}
