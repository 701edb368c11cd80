package linearizability

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// workload is how a run's workers call the store: many workers on a few keys
// at a time, with leases a few calls long, clock skew between workers (a
// fleet whose clocks differ, and step now and then), stale leases, and
// optionally short deadlines.
type workload struct {
	seed     uint64
	workers  int
	ops      int     // calls per worker
	keys     int     // keys in use at a time
	round    int64   // ticks before the workers move to fresh keys (0: never)
	skew     int64   // each worker's Now is off by up to ±skew ticks
	steps    float64 // share of calls before which a worker's clock steps to another skew
	maxLease int64   // ticks; leases and heartbeats last 1 to maxLease ticks
	window   int64   // ticks; Claim.ReplayWindow
	timeouts float64 // share of calls made with a deadline of 50 µs to 5 ms
	owner    string  // workers' owner tokens are owner + index
	client   int     // the first porcupine ClientId
	oneTx    bool    // a third of the claims are requests in one transaction (opClaimTx)
}

// callTimeout bounds every call that has no short deadline.
const callTimeout = 2 * time.Second

// worker is one goroutine's state: the leases it holds per key (newest
// last) and the ones it lost or gave up, which it still writes with now and
// then, as an owner whose lease expired would.
type worker struct {
	w      *workload
	id     int
	owner  string
	rnd    *rand.Rand
	skew   int64
	client int
	held   map[string][]int64 // key -> generations this worker believes it holds
	stale  map[string][]int64 // key -> generations it lost or finished
}

func (w *workload) worker(id int, clients *atomic.Int64) *worker {
	rnd := rand.New(rand.NewPCG(w.seed, uint64(id)))
	var skew int64
	if w.skew > 0 {
		skew = rnd.Int64N(2*w.skew+1) - w.skew
	}
	return &worker{
		w: w, id: id, owner: fmt.Sprintf("%s%d", w.owner, id), rnd: rnd, skew: skew,
		client: int(clients.Add(1)) - 1 + w.client,
		held:   map[string][]int64{}, stale: map[string][]int64{},
	}
}

// runStats counts what a run's calls returned, to show that the history
// exercises what the check is about.
type runStats struct {
	calls, unknown, created, restarted, takenOver, existing, leaseLost, notFound, writes atomic.Int64
	// oneTx counts the opClaimTx calls that created a record in their unit.
	oneTx atomic.Int64

	mu     sync.Mutex
	causes map[string]int // why outcomes were unknown
}

func (s *runStats) String() string {
	str := fmt.Sprintf("%d calls: %d unknown; claims %d created (%d restarts after the window), "+
		"%d taken over, %d existing; %d fenced writes ok, %d lease lost; %d not found; "+
		"%d claims in one transaction",
		s.calls.Load(), s.unknown.Load(), s.created.Load(), s.restarted.Load(), s.takenOver.Load(),
		s.existing.Load(), s.writes.Load(), s.leaseLost.Load(), s.notFound.Load(), s.oneTx.Load())
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.causes) > 0 {
		str += fmt.Sprintf("; unknown because of %v", s.causes)
	}
	return str
}

// add adds o's counts to s's (the rounds of one phase, checked together).
func (s *runStats) add(o *runStats) {
	for _, c := range []struct{ dst, src *atomic.Int64 }{
		{&s.calls, &o.calls}, {&s.unknown, &o.unknown}, {&s.created, &o.created},
		{&s.restarted, &o.restarted}, {&s.takenOver, &o.takenOver}, {&s.existing, &o.existing},
		{&s.leaseLost, &o.leaseLost}, {&s.notFound, &o.notFound}, {&s.writes, &o.writes},
		{&s.oneTx, &o.oneTx},
	} {
		c.dst.Add(c.src.Load())
	}
}

func (s *runStats) count(in input, out output, err error) {
	s.calls.Add(1)
	switch {
	case out.Unknown:
		s.unknown.Add(1)
		s.mu.Lock()
		if s.causes == nil {
			s.causes = map[string]int{}
		}
		s.causes[cause(err)]++
		s.mu.Unlock()
	case out.Err == errLeaseLost:
		s.leaseLost.Add(1)
	case out.Err == errNotFound:
		s.notFound.Add(1)
	case in.Op == opClaimTx && out.Outcome == idempotency.ClaimCreated:
		s.oneTx.Add(1)
	case in.Op == opClaimTx:
		s.existing.Add(1)
	case in.Op == opClaim && out.Outcome == idempotency.ClaimCreated:
		s.created.Add(1)
		if out.Rec.Gen > 1 {
			s.restarted.Add(1)
		}
	case in.Op == opClaim && out.Outcome == idempotency.ClaimTakenOver:
		s.takenOver.Add(1)
	case in.Op == opClaim:
		s.existing.Add(1)
	case in.Op != opGet:
		s.writes.Add(1)
	}
}

// env is where a run's calls go and what they are recorded in.
type env struct {
	c        caller
	clk      *clock
	keys     *keyspace // nil: the keys never move on
	rec      sink
	st       *runStats
	deadline time.Time     // no call starts after it
	stop     chan struct{} // nil, or closed to stop the calls
	progress *atomic.Int64 // nil, or counts the calls made
}

// run makes the workload's calls until every worker made its calls, e.stop
// is closed or e.deadline passes.
func (w *workload) run(e env) {
	var clients atomic.Int64
	var wg sync.WaitGroup
	for id := range w.workers {
		wk := w.worker(id, &clients)
		wg.Go(func() {
			for range w.ops {
				select {
				case <-e.stop:
					return
				default:
				}
				if time.Now().After(e.deadline) {
					return
				}
				wk.call(e, &clients)
				if e.progress != nil {
					e.progress.Add(1)
				}
			}
		})
	}
	wg.Wait()
}

// keyspace moves a key slot on to a fresh key once its key has had
// maxUnknown calls of unknown outcome: each stays open until the end of its
// key's history, and porcupine's search grows exponentially with the calls
// open at once.
type keyspace struct {
	maxUnknown int
	mu         sync.Mutex
	unknown    map[string]int // key -> calls of unknown outcome
	moved      map[string]int // slot -> how often it moved on
}

func newKeyspace(maxUnknown int) *keyspace {
	return &keyspace{maxUnknown: maxUnknown, unknown: map[string]int{}, moved: map[string]int{}}
}

func (ks *keyspace) key(slot string) string {
	if ks == nil {
		return slot
	}
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return fmt.Sprintf("%s-m%d", slot, ks.moved[slot])
}

func (ks *keyspace) unknownOn(slot, key string) {
	if ks == nil {
		return
	}
	ks.mu.Lock()
	defer ks.mu.Unlock()
	ks.unknown[key]++
	if ks.unknown[key] >= ks.maxUnknown && key == fmt.Sprintf("%s-m%d", slot, ks.moved[slot]) {
		ks.moved[slot]++
	}
}

func (wk *worker) call(e env, clients *atomic.Int64) {
	w, clk := wk.w, e.clk
	if w.steps > 0 && wk.rnd.Float64() < w.steps {
		wk.skew = wk.rnd.Int64N(2*w.skew+1) - w.skew // a clock that steps, back or forth
	}
	tick := clk.tick.Add(1)
	slot := fmt.Sprintf("k%d", wk.rnd.IntN(w.keys))
	if w.round > 0 {
		slot = fmt.Sprintf("r%d-%s", tick/w.round, slot)
	}
	key := e.keys.key(slot)
	in := wk.choose(key, clk.at(tick+wk.skew), clk.unit, tick)
	timeout := callTimeout
	if wk.rnd.Float64() < w.timeouts {
		timeout = time.Duration(50+wk.rnd.IntN(5000)) * time.Microsecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	call := e.rec.begin(wk.client, in)
	out, err := e.c.do(ctx, in)
	out.Upper = clk.at(clk.tick.Load() + w.skew)
	e.rec.end(call, out)
	cancel()
	e.st.count(in, out, err)
	wk.learn(in, out)
	if out.Unknown {
		// A call with an unknown outcome stays open for ever in the
		// history: the worker goes on as another client.
		wk.client = int(clients.Add(1)) - 1 + w.client
		e.keys.unknownOn(slot, key)
	}
}

// choose draws the next call on key at now.
func (wk *worker) choose(key string, now, unit, tick int64) input {
	w, rnd := wk.w, wk.rnd
	ticks := func(n int64) int64 { return n * unit }
	in := input{Key: key, Owner: wk.owner, Now: now}
	held := wk.held[key]
	p := rnd.Float64()
	switch {
	case len(held) == 0 && p < 0.7, p < 0.15:
		in.Op = opClaim
		in.LeaseFor = ticks(1 + rnd.Int64N(w.maxLease))
		in.Window = ticks(w.window)
		in.FP = "fp-a"
		if rnd.IntN(10) == 0 {
			in.FP = "fp-b" // another request under the same key: never taken over by this one
		}
		in.TakeoverOnly = rnd.IntN(20) == 0
		in.Request = fmt.Sprintf("req-%s-%d", wk.owner, tick)
		if w.oneTx && rnd.IntN(3) == 0 {
			in.Op, in.TakeoverOnly, in.Commit = opClaimTx, false, rnd.IntN(5) > 0
			in.Resp = response{Status: 201, Header: wk.owner + "/tx",
				Body: fmt.Sprintf("body-%s-%d", wk.owner, tick)}
		}
		return in
	case len(held) == 0 || p < 0.22:
		in.Op = opGet
		return in
	}
	in.Gen = held[len(held)-1]
	switch stale := wk.stale[key]; {
	case rnd.IntN(5) == 0 && len(stale) > 0:
		in.Gen = stale[rnd.IntN(len(stale))] // an owner whose lease was lost writes on
	case rnd.IntN(10) == 0:
		in.Gen = 1 + rnd.Int64N(4) // a guess: a lease this owner may or may not hold
	case len(held) > 1 && rnd.IntN(4) == 0:
		in.Gen = held[rnd.IntN(len(held))]
	}
	switch q := rnd.IntN(100); {
	case q < 20:
		in.Op = opHeartbeat
		in.Until = now + ticks(rnd.Int64N(w.maxLease+1))
	case q < 26: // a heartbeat that ends the lease, as the middleware's for a resume
		in.Op = opHeartbeat
		in.Until = now
	case q < 46:
		in.Op = opSetPoint
		in.Point = fmt.Sprintf("phase-%d", tick)
		if rnd.IntN(4) > 0 {
			in.Data = fmt.Sprintf("data-%s-%d", wk.owner, tick)
		}
	case q < 80:
		in.Op = opComplete
		in.Resp = response{
			Status: 200 + rnd.IntN(3),
			Header: fmt.Sprintf("%s/%d", wk.owner, in.Gen),
			Body:   fmt.Sprintf("body-%s-%d", wk.owner, tick),
		}
	case q < 92:
		in.Op = opRelease
	default:
		in.Op = opGet
	}
	return in
}

// learn updates the leases the worker believes it holds from what a call
// returned.
func (wk *worker) learn(in input, out output) {
	if out.Unknown {
		return
	}
	k := in.Key
	switch {
	case in.Op == opClaim && out.Outcome != idempotency.ClaimExisting:
		wk.hold(k, out.Rec.Gen)
	case in.Op == opClaimTx: // its lease ended with its unit
	case in.Op == opClaim || in.Op == opGet:
		if out.Err == errNone && out.Rec.State == idempotency.InProgress && out.Rec.Owner == wk.owner {
			wk.hold(k, out.Rec.Gen) // its own lease, seen again
		}
	case out.Err == errLeaseLost, in.Op == opComplete, in.Op == opRelease:
		wk.drop(k, in.Gen)
	}
}

func (wk *worker) hold(k string, gen int64) {
	held := wk.held[k]
	for _, g := range held {
		if g == gen {
			return
		}
	}
	held = append(held, gen)
	if len(held) > 3 {
		wk.stale[k] = appendCapped(wk.stale[k], held[0])
		held = held[1:]
	}
	wk.held[k] = held
}

func (wk *worker) drop(k string, gen int64) {
	held := wk.held[k]
	for i, g := range held {
		if g == gen {
			wk.held[k] = append(held[:i:i], held[i+1:]...)
			wk.stale[k] = appendCapped(wk.stale[k], gen)
			return
		}
	}
}

func appendCapped(s []int64, v int64) []int64 {
	s = append(s, v)
	if len(s) > 4 {
		s = s[1:]
	}
	return s
}

// cause names the error that left a call's outcome unknown, briefly.
func cause(err error) string {
	switch {
	case err == nil:
		return "none"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	}
	msg := err.Error()
	for _, c := range []string{"administrator command", "reset by peer", "broken pipe", "EOF",
		"closed"} {
		if strings.Contains(msg, c) {
			return c
		}
	}
	if len(msg) > 60 {
		msg = msg[len(msg)-60:]
	}
	return msg
}
