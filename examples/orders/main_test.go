//go:build unix

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/idempotency"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// 200 orders through a proxy that resets connections before the server
// and after its answer: the client's retries leave many outcomes unknown;
// resolved without the lookup (every unknown order sent again) and with it
// (sent again only when absent), every order takes effect once, and its
// caller ends with the response that names it. The lookup sends again only
// the orders the server never got.
func TestOrdersTakeEffectOnceEach(t *testing.T) {
	if testing.Short() {
		t.Skip("sends 400 orders through toxiproxy")
	}
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	figs, err := run(t.Context(), cfg, &out)
	require.NoError(t, err)
	t.Log("\n" + out.String())
	require.Len(t, figs, 2)
	without, with := figs[0], figs[1]
	for _, f := range figs {
		require.True(t, f.ok(200), "%s: %+v", f.mode, f)
		require.Positive(t, f.unknownAfterLoop, "%s: the faults left outcomes unknown", f.mode)
		require.Less(t, f.unknownAfterLoop, 200)
	}
	require.Equal(t, without.unknownAfterLoop, without.resends, "without the lookup, every "+
		"unknown order is sent again")
	require.Equal(t, with.unknownAfterLoop, with.lookups, "one lookup per unknown order")
	require.Less(t, with.resends, with.unknownAfterLoop, "the lookup sends again only the absent")
	require.Equal(t, int64(with.lookups), with.reachedGET)
	require.Contains(t, out.String(), "PASS with lookup")
}

// The faults go on while the caller resolves: lookups and re-sends are cut
// too, and the rounds go on until every order is settled, still once each.
func TestOrdersOutageDuringResolution(t *testing.T) {
	if testing.Short() {
		t.Skip("sends orders through toxiproxy")
	}
	cfg, err := parseFlags([]string{"-orders", "60", "-outage-rounds", "3"}, io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	figs, err := run(t.Context(), cfg, &out)
	require.NoError(t, err)
	t.Log("\n" + out.String())
	for _, f := range figs {
		require.True(t, f.ok(60), "%s: %+v", f.mode, f)
	}
	require.Greater(t, figs[1].rounds, 1, "lookups were cut too")
}

// cardProcessor de-duplicates charges by key and counts calls and
// lookups; hold, when set, makes a charge wait (after it is recorded) until
// released.
type cardProcessor struct {
	*httptest.Server
	delay    time.Duration
	received chan string // a charge received, before it answers
	release  chan struct{}
	mu       sync.Mutex
	charges  map[string]string
	calls    map[string]int
	lookups  map[string]int
}

func newCardProcessor(t *testing.T, delay time.Duration, hold bool) *cardProcessor {
	p := &cardProcessor{delay: delay, received: make(chan string, 8),
		charges: map[string]string{}, calls: map[string]int{}, lookups: map[string]int{}}
	if hold {
		p.release = make(chan struct{})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		p.mu.Lock()
		p.calls[key]++
		c, ok := p.charges[key]
		if !ok {
			c = fmt.Sprintf("ch_%d", len(p.charges)+1)
			p.charges[key] = c
		}
		p.mu.Unlock()
		p.received <- key
		if p.release != nil {
			<-p.release
		}
		time.Sleep(p.delay)
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, c)
	})
	mux.HandleFunc("GET /charges/{key}", func(w http.ResponseWriter, r *http.Request) {
		key := r.PathValue("key")
		p.mu.Lock()
		p.lookups[key]++
		c, ok := p.charges[key]
		p.mu.Unlock()
		if !ok {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, c)
	})
	p.Server = httptest.NewServer(mux)
	t.Cleanup(func() {
		if p.release != nil {
			select {
			case <-p.release:
			default:
				close(p.release)
			}
		}
		p.Close()
	})
	return p
}

func (p *cardProcessor) counts() (charges, calls, lookups int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.calls {
		calls += n
	}
	for _, n := range p.lookups {
		lookups += n
	}
	return len(p.charges), calls, lookups
}

// pgDSN returns SAFERETRY_PG_DSN, skipping the test without it unless
// SAFERETRY_REQUIRE_PG=1.
func pgDSN(t *testing.T) string {
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_PG") == "1" {
			t.Fatal("SAFERETRY_REQUIRE_PG=1 but SAFERETRY_PG_DSN is not set")
		}
		t.Skip("SAFERETRY_PG_DSN not set: skipping PostgreSQL")
	}
	return dsn
}

// A charge that takes 5 s answers 202 after a second; a client that
// follows 202s polls the monitor and gets the 201, charged once; over
// SQLite and PostgreSQL.
func TestSlowChargeIsFollowedToIts201(t *testing.T) {
	if testing.Short() {
		t.Skip("a charge takes 5 s")
	}
	for _, store := range []string{"sqlite", "pgx"} {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			dsn := filepath.Join(t.TempDir(), "orders.db")
			if store == "pgx" {
				dsn = pgDSN(t)
			}
			st, err := openStore(t.Context(), store, dsn, false)
			require.NoError(t, err)
			defer st.close()
			cards := newCardProcessor(t, 5*time.Second, false)
			svc := newService(st, serviceConfig{secret: randomSecret(), acceptAfter: time.Second,
				processor: cards.URL, logger: slog.New(slog.DiscardHandler)})
			srv := httptest.NewServer(svc.handler)
			defer srv.Close()

			var attempts []saferetry.AttemptDoneInfo
			var polls []saferetry.PollInfo
			tr := saferetry.NewTransport(nil, saferetry.WithFollowAccepted(true),
				saferetry.WithBudget(budget.NewRegistry(nil)),
				saferetry.WithLogger(slog.New(slog.DiscardHandler)),
				saferetry.WithObserver(saferetry.Observer{
					AttemptDone: func(_ context.Context, a saferetry.AttemptDoneInfo) {
						attempts = append(attempts, a)
					},
					Poll: func(_ context.Context, p saferetry.PollInfo) { polls = append(polls, p) },
				}))
			defer tr.CloseIdleConnections()
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost,
				srv.URL+"/charges", strings.NewReader(`{"amount":4200}`))
			require.NoError(t, err)
			req.Header.Set("X-Account", account)
			req.Header.Set("Content-Type", "application/json")
			start := time.Now()
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			took := time.Since(start)
			require.Equal(t, http.StatusCreated, resp.StatusCode, string(body))
			require.Contains(t, string(body), `"charge":"ch_1"`)
			require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader))
			require.Len(t, attempts, 1)
			require.Equal(t, http.StatusAccepted, attempts[0].Response.StatusCode)
			require.GreaterOrEqual(t, len(polls), 3)
			require.Equal(t, saferetry.OperationCompleted, polls[len(polls)-1].State)
			require.GreaterOrEqual(t, took, 5*time.Second, "the 201 is the charge's end")
			charges, calls, _ := cards.counts()
			require.Equal(t, 1, charges)
			require.Equal(t, 1, calls)
		})
	}
}

// proc is a server process of the crash test.
type proc struct {
	url  string
	cmd  *exec.Cmd
	done chan struct{}
}

func startServer(t *testing.T, bin string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"-serve", "127.0.0.1:0"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	select {
	case line, ok := <-lines:
		require.True(t, ok, "the server exited before listening")
		addr, found := strings.CutPrefix(line, "listening on ")
		require.True(t, found, "unexpected first line %q", line)
		p.url = "http://" + addr
	case <-time.After(60 * time.Second):
		t.Fatal("the server did not start")
	}
	return p
}

type answer struct {
	status int
	header http.Header
	body   string
}

func get(t *testing.T, url, path string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url+path, nil)
	require.NoError(t, err)
	req.Header.Set("X-Account", account)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 30 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// A server process killed (SIGKILL) while its charge is at the card
// processor: the monitor said in progress before the kill, says in
// progress on a fresh process until its Completer takes the request over
// (after the lease), which looks the charge up instead of charging again;
// then the monitor says completed, with the 201. The card was charged
// once.
func TestKilledMidChargeTheCompleterFinishesIt(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	bin := filepath.Join(t.TempDir(), "orders")
	out, err := exec.CommandContext(t.Context(), "go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	db := filepath.Join(t.TempDir(), "orders.db")
	cards := newCardProcessor(t, 0, true)
	secret := hex.EncodeToString(randomSecret())
	args := []string{"-driver", "sqlite", "-dsn", db, "-processor", cards.URL, "-lease",
		"500ms", "-secret", secret}

	a := startServer(t, bin, append(args, "-accept-after", "200ms")...)
	req, err := http.NewRequest(http.MethodPost, a.url+"/charges",
		strings.NewReader(`{"amount":4200}`))
	require.NoError(t, err)
	req.Header.Set("X-Account", account)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "charge-order-42")
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusAccepted, resp.StatusCode)
	monitor := resp.Header.Get("Location")
	require.True(t, strings.HasPrefix(monitor, "/operations/"), monitor)
	require.NotContains(t, monitor, "order-42")
	<-cards.received
	require.Equal(t, http.StatusAccepted, get(t, a.url, monitor).status, "in progress")

	require.NoError(t, a.cmd.Process.Signal(syscall.SIGKILL))
	<-a.done
	ws, ok := a.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "%v",
		a.cmd.ProcessState)
	close(cards.release)

	b := startServer(t, bin, append(args, "-completer", "100ms")...)
	require.Equal(t, http.StatusAccepted, get(t, b.url, monitor).status,
		"in progress: the dead process's lease, then the Completer's run")
	var done answer
	require.Eventually(t, func() bool {
		done = get(t, b.url, monitor)
		return done.status != http.StatusAccepted
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, http.StatusCreated, done.status, done.body)
	require.Equal(t, "true", done.header.Get(idempotency.ReplayedHeader))
	require.Contains(t, done.body, `"charge":"ch_1"`)
	require.Contains(t, done.body, fmt.Sprintf(`"pid":%d`, b.cmd.Process.Pid),
		"completed by the fresh process's Completer")
	lookup := get(t, b.url, "/operations/", "Idempotency-Key", "charge-order-42",
		"Idempotency-Lookup", "POST /charges")
	require.Equal(t, done.body, lookup.body, "the lookup by key gives the same response")
	other := get(t, b.url, monitor, "X-Account", "acct-2")
	require.Equal(t, http.StatusNotFound, other.status, "another principal")

	charges, calls, lookups := cards.counts()
	require.Equal(t, 1, charges, "charged once")
	require.Equal(t, 1, calls, "called once: the resume looked the charge up")
	require.Equal(t, 1, lookups)
}
