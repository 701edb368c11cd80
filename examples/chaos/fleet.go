package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// attemptCounter is a slog.Handler that counts the Transport's attempt
// records (one per attempt: attrs "attempt", "outcome", "class", "status")
// instead of printing them. Safe for concurrent use.
type attemptCounter struct {
	attempts   atomic.Int64
	retries    atomic.Int64 // outcome "retry"
	denials    atomic.Int64 // stop "budget_denied"
	inProgress atomic.Int64 // class "in_progress": the middleware's 409

	mu       sync.Mutex
	outcomes map[string]int64 // per attempt: the status, or the error class
}

func newAttemptCounter() *attemptCounter {
	return &attemptCounter{outcomes: map[string]int64{}}
}

func (c *attemptCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *attemptCounter) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *attemptCounter) WithGroup(string) slog.Handler            { return c }

func (c *attemptCounter) Handle(_ context.Context, r slog.Record) error {
	var isAttempt bool
	var outcome, stop, class string
	var status int64
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "attempt":
			isAttempt = true
		case "outcome":
			outcome = a.Value.String()
		case "stop":
			stop = a.Value.String()
		case "class":
			class = a.Value.String()
		case "status":
			status = a.Value.Int64()
		}
		return true
	})
	if !isAttempt {
		return nil // not an attempt record (e.g. "body too large")
	}
	c.attempts.Add(1)
	switch {
	case outcome == string(saferetry.OutcomeRetry):
		c.retries.Add(1)
	case stop == string(retry.ReasonBudget):
		c.denials.Add(1)
	}
	if class == string(retry.ClassInProgress) {
		c.inProgress.Add(1)
	}
	label := class
	if status != 0 {
		label = strconv.FormatInt(status, 10)
		if class == string(retry.ClassInProgress) {
			label += " in progress"
		}
	}
	c.mu.Lock()
	c.outcomes[label]++
	c.mu.Unlock()
	return nil
}

// outcomeSummary renders the per-attempt outcomes, most frequent first.
func (c *attemptCounter) outcomeSummary() string {
	c.mu.Lock()
	type kv struct {
		k string
		v int64
	}
	var all []kv
	for k, v := range c.outcomes {
		all = append(all, kv{k, v})
	}
	c.mu.Unlock()
	sort.Slice(all, func(i, j int) bool {
		if all[i].v != all[j].v {
			return all[i].v > all[j].v
		}
		return all[i].k < all[j].k
	})
	var b bytes.Buffer
	for i, e := range all {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %d", e.k, e.v)
	}
	return b.String()
}

// logical is one logical request: one payment, one event-derived key,
// however many attempts and re-sends it takes.
type logical struct {
	account string
	seq     int
	key     string
	body    []byte

	ok        bool  // the client saw a 2xx during the chaos phase
	paymentID int64 // from the 2xx body
	replayed  bool  // that 2xx carried Idempotent-Replayed: true
	lastErr   string

	reconciled    bool // re-sent after the chaos phase
	reconOK       bool
	reconReplayed bool
}

func newLogical(acct string, seq int) *logical {
	order := "order-" + acct + "-" + strconv.Itoa(seq)
	body, _ := json.Marshal(paymentRequest{Order: order, AmountCents: 100 + int64(seq%97)*7, Currency: "EUR"})
	return &logical{
		account: acct, seq: seq,
		// Event-derived: the same payment always gets the same key, in this
		// process or in the one that re-sends it after a crash.
		key:  keygen.Event("payment", acct, strconv.Itoa(seq)),
		body: body,
	}
}

// result is what one send of a logical request produced.
type result struct {
	ok         bool
	definitive bool // a 4xx other than 408, 409, 425 and 429: re-sending cannot help
	paymentID  int64
	replayed   bool
	err        string
}

// send runs one logical request through client (every retry happens inside
// the Transport) and reads the answer.
func send(ctx context.Context, client *http.Client, url string, l *logical) result {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(l.body))
	if err != nil {
		return result{err: err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+l.account)
	req.Header.Set("Idempotency-Key", l.key)
	resp, err := client.Do(req)
	if err != nil {
		return result{err: err.Error()}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return result{err: "reading the answer: " + err.Error()}
	}
	if resp.StatusCode/100 != 2 {
		c := resp.StatusCode
		definitive := c/100 == 4 && c != http.StatusRequestTimeout && c != http.StatusConflict &&
			c != http.StatusTooEarly && c != http.StatusTooManyRequests
		return result{err: resp.Status, definitive: definitive}
	}
	var p paymentResponse
	if err := json.Unmarshal(body, &p); err != nil || p.ID == 0 {
		return result{err: "malformed 2xx answer"}
	}
	return result{ok: true, paymentID: p.ID, replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}

// fleet is the set of clients: each has its own connection pool and Transport,
// all draw retries from one budget registry (one service process).
type fleet struct {
	url     string
	opts    []saferetry.Option
	clients int
	think   time.Duration

	done      atomic.Int64
	succeeded atomic.Int64
	failed    atomic.Int64

	mu       sync.Mutex
	logicals []*logical
	bases    []*http.Transport
}

func newBaseTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 4
	return t
}

// run starts the clients; each issues logical requests one after another
// until stop is done, then finishes the one in flight. ctx cancels
// everything (Ctrl-C).
func (f *fleet) run(ctx, stop context.Context) {
	var wg sync.WaitGroup
	for i := range f.clients {
		base := newBaseTransport()
		f.mu.Lock()
		f.bases = append(f.bases, base)
		f.mu.Unlock()
		client := &http.Client{Transport: saferetry.NewTransport(base, f.opts...)}
		acct := fmt.Sprintf("acct_%02d", i+1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 42))
			for seq := 1; stop.Err() == nil && ctx.Err() == nil; seq++ {
				l := newLogical(acct, seq)
				f.mu.Lock()
				f.logicals = append(f.logicals, l)
				f.mu.Unlock()
				r := send(ctx, client, f.url, l)
				l.ok, l.paymentID, l.replayed, l.lastErr = r.ok, r.paymentID, r.replayed, r.err
				f.done.Add(1)
				if r.ok {
					f.succeeded.Add(1)
				} else {
					f.failed.Add(1)
				}
				if f.think > 0 {
					t := time.NewTimer(time.Duration(rnd.Float64() * 2 * float64(f.think)))
					select {
					case <-t.C:
					case <-stop.Done():
						t.Stop()
					}
				}
			}
		}()
	}
	wg.Wait()
}

func (f *fleet) closeIdle() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, b := range f.bases {
		b.CloseIdleConnections()
	}
}
