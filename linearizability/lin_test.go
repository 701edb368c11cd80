package linearizability

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// phaseLimit bounds the calls of one phase in real time: its workers stop
// at it even with calls left, so that each store's check, faults and
// porcupine included, stays within 30 s.
const phaseLimit = 5 * time.Second

// maxUnknownPerKey: after this many calls of unknown outcome on a key, the
// workers move on to a fresh one (see keyspace).
const maxUnknownPerKey = 6

// contention is many workers on a few keys, no faults.
var contention = workload{
	seed: 1, workers: 8, ops: 250, keys: 3, round: 240, skew: 3, steps: 0.02, maxLease: 12, window: 40,
	owner: "w",
}

// faulty is the same under faults, with a share of calls on short deadlines.
var faulty = workload{
	seed: 2, workers: 8, ops: 200, keys: 3, round: 120, skew: 3, steps: 0.02, maxLease: 12, window: 40,
	timeouts: 0.08, owner: "w",
}

// TestLinearizable records histories of concurrent calls on every store of
// stores and checks them against the model: under contention, under faults
// (short deadlines; for a networked store also toxiproxy latency, black
// holes and resets, and connections the server terminates mid-call), and,
// for a store that processes share, with a child process killed mid-run.
func TestLinearizable(t *testing.T) {
	for _, sc := range stores {
		t.Run(sc.name, func(t *testing.T) {
			start := time.Now()
			b := sc.open(t)
			t.Run("contention", func(t *testing.T) {
				w := contention
				w.oneTx = sc.oneTx
				st := runPhase(t, b, w, nil, nil)
				requireCoverage(t, st, false, sc.oneTx)
			})
			t.Run("faults", func(t *testing.T) {
				network := b.faulty != nil || b.killConn != nil
				if !network {
					t.Log("no network between this process and the store: short deadlines are the only fault")
				}
				inject := func(ctx context.Context) string { return injectFaults(ctx, b) }
				all := &runStats{}
				for round := range max(b.faultRounds, 1) {
					w := faulty
					w.seed += uint64(round) * 10
					w.oneTx = sc.oneTx
					all.add(runPhase(t, b, w, b.faulty, inject))
				}
				requireCoverage(t, all, network, sc.oneTx)
			})
			switch {
			case sc.reopen == nil:
				t.Log("the store's state lives in this process: no process to kill")
			case !sharedClock:
				t.Log("no clock shared between processes on this system: no process killed")
			default:
				t.Run("killed_process", func(t *testing.T) { runKilled(t, sc, b) })
			}
			t.Logf("%s checked in %v", sc.name, time.Since(start).Round(time.Millisecond))
		})
	}
}

// runPhase runs w on b.store (half the workers on faulty instead when it is
// not nil) while inject runs, then checks the history.
func runPhase(t *testing.T, b *backend, w workload, faulty idempotency.Store,
	inject func(context.Context) string) *runStats {
	t.Helper()
	clk, h, st := newClock(), &history{}, &runStats{}
	principal := "lin-" + randHex(4)
	deadline := time.Now().Add(phaseLimit)
	groups := []struct {
		w     workload
		store idempotency.Store
	}{{w, b.store}}
	if faulty != nil {
		direct, proxied := w, w
		direct.workers = w.workers / 2
		proxied.workers, proxied.client = w.workers-direct.workers, direct.workers
		proxied.seed, proxied.owner = w.seed+1000, "f"
		groups = []struct {
			w     workload
			store idempotency.Store
		}{{direct, b.store}, {proxied, faulty}}
	}
	ctx, stopFaults := context.WithCancel(t.Context())
	faults := make(chan string, 1)
	if inject != nil {
		go func() { faults <- inject(ctx) }()
	}
	keys := newKeyspace(maxUnknownPerKey)
	var wg sync.WaitGroup
	for _, g := range groups {
		wg.Go(func() {
			g.w.run(env{c: caller{g.store, principal}, clk: clk, keys: keys, rec: h, st: st,
				deadline: deadline})
		})
	}
	wg.Wait()
	stopFaults()
	if inject != nil {
		t.Logf("faults: %s", <-faults)
	}
	t.Logf("history: %v", st)
	requireLinearizable(t, model{evicts: b.evicts, epoch: clk.epoch}, h.operations())
	return st
}

// requireCoverage fails t unless the history took the paths the check is
// about: creations, restarts past the replay window, takeovers, fenced
// writes that held and that failed, (under network faults) calls whose
// outcome stayed unknown, and (oneTx) records created in one transaction.
func requireCoverage(t *testing.T, st *runStats, unknown, oneTx bool) {
	t.Helper()
	var missing []string
	for _, c := range []struct {
		name string
		n    *atomic.Int64
		want bool
	}{
		{"created", &st.created, true}, {"restarted", &st.restarted, true},
		{"taken over", &st.takenOver, true}, {"existing", &st.existing, true},
		{"fenced writes", &st.writes, true}, {"lease lost", &st.leaseLost, true},
		{"unknown outcomes", &st.unknown, unknown},
		{"claims in one transaction", &st.oneTx, oneTx},
	} {
		if c.want && c.n.Load() == 0 {
			missing = append(missing, c.name)
		}
	}
	if len(missing) > 0 {
		t.Errorf("the history has no %s: the workload does not exercise them",
			strings.Join(missing, ", "))
	}
}

// injectFaults runs b's faults until ctx is done and says what it did:
// toxiproxy episodes of 10 to 40 ms (latency, black holes that close the
// connection, resets of the answer or of the request), and server-side
// terminations of connections running a statement.
func injectFaults(ctx context.Context, b *backend) string {
	var (
		wg         sync.WaitGroup
		episodes   = map[string]int{}
		terminated atomic.Int64
		errs       []string
		mu         sync.Mutex
	)
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err.Error())
		mu.Unlock()
	}
	if len(b.proxies) > 0 {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(3, 0))
			for ctx.Err() == nil {
				kind, err := toxicEpisode(ctx, b, rnd)
				if err != nil {
					fail(err)
					return
				}
				episodes[kind]++
			}
		})
	}
	if b.killConn != nil {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(4, 0))
			for wait(ctx, time.Duration(30+rnd.IntN(60))*time.Millisecond) {
				killed, err := b.killConn(ctx)
				if err != nil && ctx.Err() == nil {
					fail(err)
					return
				}
				if killed {
					terminated.Add(1)
				}
			}
		})
	}
	wg.Wait()
	s := fmt.Sprintf("toxiproxy episodes %v; connections terminated mid-statement: %d",
		episodes, terminated.Load())
	if len(errs) > 0 {
		s += "; injector errors: " + strings.Join(errs, "; ")
	}
	return s
}

// toxicEpisode applies one toxic (or none) to b.proxies for 10 to 40 ms.
func toxicEpisode(ctx context.Context, b *backend, rnd *rand.Rand) (string, error) {
	var kind, js string
	switch rnd.IntN(5) {
	case 0:
		kind, js = "latency", `"type":"latency","stream":"downstream","toxicity":1,
			"attributes":{"latency":4,"jitter":4}`
	case 1:
		kind, js = "timeout", `"type":"timeout","stream":"downstream","toxicity":0.2,
			"attributes":{"timeout":15}`
	case 2:
		kind, js = "reset_answer", `"type":"reset_peer","stream":"downstream","toxicity":0.15,
			"attributes":{"timeout":0}`
	case 3:
		kind, js = "reset_request", `"type":"reset_peer","stream":"upstream","toxicity":0.15,
			"attributes":{"timeout":0}`
	default:
		kind = "calm"
	}
	d := time.Duration(10+rnd.IntN(31)) * time.Millisecond
	if js == "" {
		wait(ctx, d)
		return kind, nil
	}
	js = `{"name":"lincheck",` + js + `}`
	for _, p := range b.proxies {
		if _, err := p.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			return kind, fmt.Errorf("toxiproxy: adding %s: %w", kind, err)
		}
	}
	wait(ctx, d)
	for _, p := range b.proxies {
		if err := p.Toxics.RemoveToxic(context.Background(), "lincheck"); err != nil {
			return kind, fmt.Errorf("toxiproxy: removing %s: %w", kind, err)
		}
	}
	return kind, nil
}

// wait waits d or until ctx is done, and reports whether ctx is still live.
func wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
