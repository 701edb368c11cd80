package linearizability

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The killed-process check: a child process (this test binary again) makes
// calls on the same store as the parent and reports each call and return on
// its stdout as it happens; the parent SIGKILLs it mid-run. The calls it had
// made and not seen return have unknown outcomes: they may or may not have
// been applied, and porcupine may linearize them anywhere after their call.

// childEnv carries a child process's configuration (JSON of childConfig).
const childEnv = "LINCHECK_CHILD"

type childConfig struct {
	Store     string `json:"store"`
	Shared    string `json:"shared"`
	Principal string `json:"principal"`
	Epoch     int64  `json:"epoch"`
	Tick      int64  `json:"tick"` // the child's clock starts here
	Seed      uint64 `json:"seed"`
	Workers   int    `json:"workers"`
}

// event is one line of a child's stdout.
type event struct {
	Ready  bool    `json:"ready,omitempty"`
	Call   int64   `json:"call,omitempty"` // the call's id, on its call line
	Ret    int64   `json:"ret,omitempty"`  // the call's id, on its return line
	Client int     `json:"client,omitempty"`
	T      int64   `json:"t,omitempty"` // monotonic
	In     *input  `json:"in,omitempty"`
	Out    *output `json:"out,omitempty"`
}

// killedWorkload is the parent's and the child's: one set of keys for the
// whole run, shared by both processes.
var killedWorkload = workload{
	workers: 4, ops: 400, keys: 3, skew: 3, steps: 0.02, maxLease: 12, window: 40,
}

const (
	// killAfter: the child is killed once it made this many calls.
	killAfter = 200
	// afterKill is how many calls each of the parent's workers makes after
	// the kill.
	afterKill = 60
	// childLimit bounds a child that nobody kills.
	childLimit = 20 * time.Second
)

func runKilled(t *testing.T, sc storeCase, b *backend) {
	clk, h, st := newClock(), &history{}, &runStats{}
	principal := "lin-" + randHex(4)
	parent := killedWorkload
	parent.seed, parent.owner, parent.oneTx = 5, "w", sc.oneTx

	cfg, err := json.Marshal(childConfig{
		Store: sc.name, Shared: b.shared, Principal: principal, Epoch: clk.epoch,
		Seed: 6, Workers: killedWorkload.workers,
	})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(cfg))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})

	// Read the child's events until its stdout closes.
	var (
		childCalls atomic.Int64
		ready      = make(chan struct{})
		childOps   []porcupine.Operation
		open       = map[int64]event{}
		readErr    error
	)
	client0 := parent.workers + 1000 // the child's porcupine clients
	go func() {
		defer close(exited)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var e event
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				readErr = fmt.Errorf("child line %q: %w", sc.Text(), err)
				break
			}
			switch {
			case e.Ready:
				close(ready)
			case e.Call != 0:
				open[e.Call] = e
				childCalls.Add(1)
			case e.Ret != 0:
				c, ok := open[e.Ret]
				if !ok {
					readErr = fmt.Errorf("child return of call %d it never made", e.Ret)
					break
				}
				delete(open, e.Ret)
				ret := e.T
				if e.Out.Unknown {
					ret = math.MaxInt64
				}
				childOps = append(childOps, porcupine.Operation{
					ClientId: client0 + c.Client, Input: *c.In, Call: c.T, Output: *e.Out, Return: ret})
			}
		}
		_ = cmd.Wait()
	}()
	select {
	case <-ready:
	case <-exited:
		t.Fatalf("the child exited before opening the store: %v\n%s", cmd.ProcessState, stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("the child did not open the store within 30 s\n%s", stderr.String())
	}

	// The parent's workers run beside the child until it is killed
	// mid-run; then fresh workers go on, on the same keys, after it.
	var progress atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	deadline := time.Now().Add(phaseLimit)
	go func() {
		defer close(done)
		parent.run(env{c: caller{b.store, principal}, clk: clk, rec: h, st: st, deadline: deadline,
			stop: stop, progress: &progress})
	}()
	for childCalls.Load() < killAfter {
		select {
		case <-exited:
			t.Fatalf("the child exited before it was killed: %v\n%s", cmd.ProcessState, stderr.String())
		case <-done:
			t.Fatalf("the parent made all its calls before the child made %d", killAfter)
		case <-time.After(time.Millisecond):
		}
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-exited
	close(stop)
	<-done
	before := progress.Load()
	after := parent
	after.seed, after.ops, after.client = 7, afterKill, 500
	after.run(env{c: caller{b.store, principal}, clk: clk, rec: h, st: st, deadline: deadline,
		progress: &progress})
	if readErr != nil {
		t.Fatal(readErr)
	}
	if code := cmd.ProcessState.ExitCode(); code != -1 {
		t.Fatalf("the child was not killed by a signal: %v\n%s", cmd.ProcessState, stderr.String())
	}
	pending := len(open)
	for _, c := range open {
		childOps = append(childOps, porcupine.Operation{
			ClientId: client0 + c.Client, Input: *c.In, Call: c.T,
			Output: output{Unknown: true, Err: errOther}, Return: math.MaxInt64})
	}
	t.Logf("child: %d calls, killed with %d in flight, their outcome unknown; parent: %d calls "+
		"beside the child, %d after; %v", childCalls.Load(), pending, before, progress.Load()-before, st)
	if pending == 0 {
		t.Error("the child had no call in flight when it was killed")
	}
	h.add(childOps...)
	requireLinearizable(t, model{evicts: b.evicts, epoch: clk.epoch}, h.operations())
}

// childMain is a child process: it opens the store its configuration names
// and makes calls until it is killed (or childLimit passes), reporting each
// call and return on stdout before and after it is made.
func childMain(cfgJSON string) int {
	var cfg childConfig
	if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	sc, err := lookupStore(cfg.Store)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	store, closeStore, err := sc.reopen(cfg.Shared)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	defer closeStore()
	out := &childSink{}
	out.write(event{Ready: true})
	clk := &clock{epoch: cfg.Epoch, unit: newClock().unit}
	clk.tick.Store(cfg.Tick)
	w := killedWorkload
	w.seed, w.workers, w.ops, w.owner, w.oneTx = cfg.Seed, cfg.Workers, math.MaxInt32, "c", sc.oneTx
	w.run(env{c: caller{store, cfg.Principal}, clk: clk, rec: out, st: &runStats{},
		deadline: time.Now().Add(childLimit)})
	return 0
}

// childSink writes each call and return as one line on stdout, at once:
// a call's line is in the pipe before the call is made, so the parent
// knows of it even if the process dies during the call.
type childSink struct {
	mu   sync.Mutex
	next int64
}

func (s *childSink) write(e event) {
	b, err := json.Marshal(e)
	if err != nil {
		panic(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := os.Stdout.Write(append(b, '\n')); err != nil {
		os.Exit(3) // the parent is gone
	}
}

func (s *childSink) begin(client int, in input) any {
	s.mu.Lock()
	s.next++
	id := s.next
	s.mu.Unlock()
	s.write(event{Call: id, Client: client, T: monotonic(), In: &in})
	return id
}

func (s *childSink) end(call any, out output) {
	s.write(event{Ret: call.(int64), T: monotonic(), Out: &out})
}
