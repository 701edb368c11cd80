//go:build unix

package redisstore_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// cardProcessor is the fake external service: it de-duplicates charges by
// Idempotency-Key and counts calls and lookups per key.
type cardProcessor struct {
	*httptest.Server
	mu      sync.Mutex
	charges map[string]string
	calls   map[string]int
	lookups map[string]int
}

func newCardProcessor(t *testing.T) *cardProcessor {
	p := &cardProcessor{charges: map[string]string{}, calls: map[string]int{}, lookups: map[string]int{}}
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
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, c)
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
		_, _ = io.WriteString(w, c)
	})
	p.Server = httptest.NewServer(mux)
	t.Cleanup(p.Close)
	return p
}

func (p *cardProcessor) counts() (calls, lookups map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	calls, lookups = map[string]int{}, map[string]int{}
	for k, v := range p.calls {
		calls[k] = v
	}
	for k, v := range p.lookups {
		lookups[k] = v
	}
	return calls, lookups
}

// requireKilled waits for the process to die and checks it was SIGKILL.
func (p *proc) requireKilled(t *testing.T) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the process did not die")
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "exit: %v", p.cmd.ProcessState)
}

type payAnswer struct {
	status   int
	body     string
	replayed bool
}

func pay(url, key string) (payAnswer, error) {
	req, err := http.NewRequest(http.MethodPost, url+"/payments", strings.NewReader(`{"amount":4200}`))
	if err != nil {
		return payAnswer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Account", "acct-1")
	// A fresh connection per request: net/http would otherwise re-send a
	// keyed request on its own when a reused connection breaks.
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return payAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return payAnswer{resp.StatusCode, string(b), resp.Header.Get(idempotency.ReplayedHeader) == "true"}, err
}

// payUntilSettled retries while the previous owner's lease is alive (409
// in progress), as a client does.
func payUntilSettled(t *testing.T, url, key string) payAnswer {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		a, err := pay(url, key)
		require.NoError(t, err)
		if a.status != http.StatusConflict || time.Now().After(deadline) {
			return a
		}
		require.Contains(t, a.body, idempotency.CodeInProgress)
		time.Sleep(50 * time.Millisecond)
	}
}

// crashEnv is one Redis deployment that several phaseserver processes
// share in turn, under one prefix.
type crashEnv struct {
	b      backend
	prefix string
	store  *redisstore.Store // the test's own view of the records
	bin    string
}

func (e crashEnv) start(t *testing.T, processor string, args ...string) *proc {
	t.Helper()
	return startServer(t, e.bin, append(append(redisArgs(t, e.b, e.prefix), "-processor", processor, "-lease", "500ms"), args...)...)
}

func (e crashEnv) record(t *testing.T, key string) idempotency.Record {
	t.Helper()
	rec, err := e.store.Get(t.Context(), idempotency.Scope{Principal: "acct-1", Method: http.MethodPost,
		Route: "POST /payments", Key: key})
	require.NoError(t, err)
	return rec
}

// requireOneOrder checks the business keys: the order phase ran once, in
// the killed process, and its order has one receipt.
func requireOneOrder(t *testing.T, e crashEnv, key string, orderPID int) {
	t.Helper()
	rdb := e.b.client(t)
	require.Equal(t, "1", rdb.Get(t.Context(), e.prefix+"order-runs:"+key).Val(), "the order phase ran once")
	orders := rdb.SMembers(t.Context(), e.prefix+"orders:"+key).Val()
	require.Len(t, orders, 1, "one order")
	require.Contains(t, orders[0], fmt.Sprintf("/%d/", orderPID), "made by the killed process")
	require.NotEmpty(t, rdb.Get(t.Context(), e.prefix+"receipt:"+orders[0]).Val(), "one receipt")
}

func forEachCrashEnv(t *testing.T, f func(t *testing.T, e crashEnv)) {
	bin := buildServer(t, "phaseserver")
	forEach(t, func(t *testing.T, b backend) {
		rdb := b.client(t)
		prefix := freshPrefix(t, rdb)
		s := openStore(t, rdb, redisstore.WithPrefix(prefix+"idem:"))
		f(t, crashEnv{b: b, prefix: prefix, store: s, bin: bin})
	})
}

// TestCrashRecovery is the crash-recovery gate on Redis and on a Redis
// Cluster, with real processes killed by SIGKILL:
//
//  1. killed between the order phase and the charge: a client retry on a
//     fresh process resumes at the charge; the processor saw one call;
//  2. killed after the processor answered, before the charge phase
//     committed: the retry finds the intent, looks the charge up by its
//     downstream key instead of calling again, and completes.
//
// Either way the order phase does not run again, the response is stored,
// and a later retry gets it replayed.
func TestCrashRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	forEachCrashEnv(t, func(t *testing.T, e crashEnv) {
		for _, tc := range []struct {
			crash, point string
			lookups      int
		}{
			{crash: "after-order", point: "order", lookups: 0},
			{crash: "after-charge", point: "intent:charge", lookups: 1},
		} {
			t.Run(tc.crash, func(t *testing.T) {
				cards := newCardProcessor(t)
				key := "order-42-" + tc.crash

				a := e.start(t, cards.URL, "-crash", tc.crash)
				_, err := pay(a.url, key)
				require.Error(t, err, "the process died without answering")
				a.requireKilled(t)

				rec := e.record(t, key)
				require.Equal(t, idempotency.InProgress, rec.State)
				require.Equal(t, tc.point, rec.RecoveryPoint)
				var recovery struct { // the recovery data Phase and External write
					Phases  []struct{ Name string }
					Pending *struct {
						DownstreamKey string `json:"downstream_key"`
					}
				}
				require.NoError(t, json.Unmarshal(rec.RecoveryData, &recovery))
				require.Equal(t, "order", recovery.Phases[0].Name)
				calls, _ := cards.counts()
				if tc.crash == "after-order" {
					require.Empty(t, calls, "killed before the charge")
				} else {
					require.Len(t, calls, 1, "the processor charged before the kill")
					require.NotNil(t, recovery.Pending, "the intent was recorded before the call")
					require.Equal(t, 1, calls[recovery.Pending.DownstreamKey])
				}

				b := e.start(t, cards.URL)
				first := payUntilSettled(t, b.url, key)
				require.Equal(t, http.StatusCreated, first.status, first.body)
				require.False(t, first.replayed)
				require.Contains(t, first.body, fmt.Sprintf(`"receipt_pid":%d`, b.cmd.Process.Pid), "completed by the fresh process")

				calls, lookups := cards.counts()
				require.Len(t, calls, 1, "one downstream key")
				for k, n := range calls {
					require.Equal(t, 1, n, "the processor saw the charge %s once", k)
					require.Equal(t, tc.lookups, lookups[k], "lookups of %s", k)
				}
				requireOneOrder(t, e, key, a.cmd.Process.Pid)
				rec = e.record(t, key)
				require.Equal(t, idempotency.Completed, rec.State)
				require.EqualValues(t, 2, rec.Generation, "one takeover")

				again, err := pay(b.url, key)
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, again.status)
				require.True(t, again.replayed)
				require.Equal(t, first.body, again.body)
				calls, _ = cards.counts()
				require.Len(t, calls, 1)
			})
		}
	})
}

// TestCrashCompleter: a request abandoned by a kill, with no client retry,
// is completed by the Completer of a fresh process once the lease expired
// (it finds the record through the lease index); a later client retry gets
// the replay.
func TestCrashCompleter(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	forEachCrashEnv(t, func(t *testing.T, e crashEnv) {
		for _, crash := range []string{"after-order", "after-charge"} {
			t.Run(crash, func(t *testing.T) {
				cards := newCardProcessor(t)
				key := "order-7-" + crash
				a := e.start(t, cards.URL, "-crash", crash)
				_, err := pay(a.url, key)
				require.Error(t, err)
				a.requireKilled(t)

				b := e.start(t, cards.URL, "-completer", "50ms")
				deadline := time.Now().Add(30 * time.Second)
				for e.record(t, key).State != idempotency.Completed {
					require.True(t, time.Now().Before(deadline), "the completer did not complete the request")
					time.Sleep(20 * time.Millisecond)
				}
				calls, lookups := cards.counts()
				require.Len(t, calls, 1)
				for k, n := range calls {
					require.Equal(t, 1, n, "charged once")
					if crash == "after-charge" {
						require.Equal(t, 1, lookups[k], "the completer looked the charge up")
					}
				}
				requireOneOrder(t, e, key, a.cmd.Process.Pid)

				replay, err := pay(b.url, key)
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, replay.status, replay.body)
				require.True(t, replay.replayed, "the client's retry gets the stored response")
				require.Contains(t, replay.body, fmt.Sprintf(`"receipt_pid":%d`, b.cmd.Process.Pid))
			})
		}
	})
}
