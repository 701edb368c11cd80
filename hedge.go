package saferetry

import (
	"context"
	"errors"
	"math"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/retry"
)

// Hedging configures hedged requests (WithHedging): when the attempts in
// flight have had no response headers for Delay, the Transport sends one
// more, a hedge, beside them. The zero value means an adaptive delay and
// one hedge.
type Hedging struct {
	// Delay is how long the attempts in flight go without response
	// headers before a hedge is sent. 0, or less, means adaptive: the
	// host's recent p95 latency (to the response headers), from a small
	// estimate per host of this Transport, clamped to 5 ms..10 s; a host
	// hedges only once the estimate has 20 answers.
	Delay time.Duration
	// MaxHedges is how many hedges may be in flight at once beside the
	// attempt they hedge. 0 means 1; below 0 turns hedging off.
	MaxHedges int
}

// The adaptive delay's estimate and bounds.
const (
	minHedgeDelay  = 5 * time.Millisecond
	maxHedgeDelay  = 10 * time.Second
	minHedgeSample = 20  // answers before a host hedges
	halfLife       = 256 // answers after which the counts halve: the estimate is recent
	perDoubling    = 4   // histogram buckets per doubling of the latency
)

// buckets is the histogram's size: bucket 0 holds latencies below
// minHedgeDelay, bucket i > 0 those below minHedgeDelay * 2^(i/perDoubling),
// the last one everything longer.
var buckets = 2 + int(math.Ceil(perDoubling*
	math.Log2(float64(maxHedgeDelay)/float64(minHedgeDelay))))

// estimate is a host's recent latencies: a histogram on a log scale whose
// counts halve every halfLife answers. Safe for concurrent use.
type estimate struct {
	mu     sync.Mutex
	counts []uint32
	total  uint32 // the sum of counts
	since  int    // answers since the last halving
	seen   int    // answers in all, up to minHedgeSample
}

func newEstimate() *estimate { return &estimate{counts: make([]uint32, buckets)} }

// add records one answer's latency.
func (e *estimate) add(d time.Duration) {
	i := 0
	if d >= minHedgeDelay {
		i = 1 + int(perDoubling*math.Log2(float64(d)/float64(minHedgeDelay)))
		i = min(i, len(e.counts)-1)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.counts[i]++
	e.total++
	e.seen = min(e.seen+1, minHedgeSample)
	if e.since++; e.since >= halfLife {
		e.since, e.total = 0, 0
		for j := range e.counts {
			e.counts[j] /= 2
			e.total += e.counts[j]
		}
	}
}

// p95 returns the upper bound of the bucket that holds the 95th percentile,
// clamped to minHedgeDelay..maxHedgeDelay, and false while the estimate
// has fewer than minHedgeSample answers.
func (e *estimate) p95() (time.Duration, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.seen < minHedgeSample || e.total == 0 {
		return 0, false
	}
	rank := uint32(math.Ceil(0.95 * float64(e.total)))
	var sum uint32
	for i, n := range e.counts {
		if sum += n; sum >= rank {
			if i == 0 {
				return minHedgeDelay, true
			}
			d := time.Duration(float64(minHedgeDelay) * math.Exp2(float64(i)/perDoubling))
			return min(d, maxHedgeDelay), true
		}
	}
	return maxHedgeDelay, true
}

// hedgeable reports whether the call may be hedged at all: it may be sent
// again whatever its outcome (see the package documentation), and a POST or
// PATCH only when it has a key, which every hedge carries, so that the
// server answers all but one with the in-progress conflict or the replay.
// Its body must be replayable, and it must be allowed more than one
// attempt.
func (c *call) hedgeable(method string) bool {
	cfg := &c.t.cfg
	if !cfg.hedging || cfg.hedge.MaxHedges < 0 || !c.idempotent || c.maxAttempts < 2 ||
		c.notRetrying != "" {
		return false
	}
	if (method == http.MethodPost || method == http.MethodPatch) && c.key == "" {
		return false
	}
	return c.body == nil || c.getBody != nil
}

// hedgeDelay returns the hedge delay of the call's next round of attempts,
// and false when the round is not hedged: the call may not hedge, or may no
// more, or the host's adaptive estimate has too few answers yet.
func (c *call) hedgeDelay() (time.Duration, bool) {
	if !c.mayHedge || c.noHedge {
		return 0, false
	}
	if d := c.t.cfg.hedge.Delay; d > 0 {
		return d, true
	}
	return c.est.p95()
}

// heard takes note of attempt a's outcome, whether or not it is hedged: its
// latency feeds the host's adaptive estimate, and an answer with the mark
// "retried below" or a Retry-After ends the call's hedging (never hedge
// after pushback).
func (c *call) heard(a *attempt) {
	if c.est != nil && a.resp != nil {
		c.est.add(a.answered.Sub(a.start))
	}
	if hop.Marked(a.resp) || a.d.HasRetryAfter {
		c.noHedge = true
	}
}

// errLost is the cause of the context of an attempt that another attempt
// of its call won against.
var errLost = errors.New("saferetry: another attempt won")

// flight is what the attempts in flight at once share with the loop.
type flight struct {
	// results carries every attempt's outcome, once. It is unbuffered, so
	// that nothing grows with the attempt limit: the loop receives the
	// outcome of every attempt it sent before the round ends.
	results chan *attempt

	// The drains of the answers the rounds discarded (discard), each on a
	// goroutine of its own, and their attempts, whose cancellation ends a
	// drain. They belong to the body RoundTrip returns: end, called when
	// that body is closed or when RoundTrip returns without one, ends them.
	drains   sync.WaitGroup
	draining []*attempt
}

// end ends the drains still running and waits for them. f may be nil (the
// call hedged no round). Safe to call more than once.
func (f *flight) end() {
	if f == nil {
		return
	}
	for _, a := range f.draining {
		a.cancel(nil)
	}
	f.drains.Wait()
}

// fly sends attempt a on its own goroutine and hands its outcome to the
// loop. A panic of the base transport or of a rule is handed over too, and
// raised again on the goroutine of RoundTrip, as it would be without
// hedging.
func (c *call) fly(a *attempt) {
	defer func() {
		a.panicked = recover()
		c.fl.results <- a
	}()
	c.roundTrip(a)
}

// hedged runs one round of attempts: a, and the hedges sent beside it each
// time the attempts in flight have gone delay without response headers. It
// returns the attempt the loop judges next, with no other attempt of the
// round left in flight:
//   - the first final answer (one the loop would not retry), handed over:
//     the attempts still in flight lose (settle), and any answer set aside
//     is discarded;
//   - otherwise, once every attempt has ended, the last retryable answer,
//     or, when none came, the last outcome, an error.
//
// A retryable answer or an error that comes while other attempts are in
// flight is set aside (the last answer, its time limit stopped: the
// others' limits bound the wait) or discarded, and the round waits for the
// others: a hedge never makes the caller's answer worse. A hedge
// answers slowness, not failure: once an attempt of the round has failed,
// the round sends no more hedges, and what follows it is a retry, after
// its backoff. Every discarded answer is drained (bounded) and closed;
// every attempt of the round but the one returned is told to the
// AttemptDone observers, as lost or discarded.
func (c *call) hedged(ctx context.Context, a *attempt, delay time.Duration) *attempt {
	if c.fl == nil {
		c.fl = &flight{results: make(chan *attempt)}
	}
	f := c.fl
	live := append(make([]*attempt, 0, 2), a)
	go c.fly(a)
	timer := time.NewTimer(delay)
	defer timer.Stop()
	var (
		held   *attempt // the last retryable answer, set aside
		failed bool     // an attempt of the round failed: no more hedges, a retry backs off
	)
	for {
		select {
		case b := <-f.results:
			live = slices.DeleteFunc(live, func(x *attempt) bool { return x == b })
			if b.panicked != nil {
				c.settle(live, held)
				b.close(time.Time{})
				panic(b.panicked)
			}
			c.heard(b)
			if b.resp != nil && (!b.d.Retry || hop.Marked(b.resp)) {
				if b.handOver() {
					if p := c.settle(live, held); p != nil {
						b.resp.Body.Close()
						panic(p)
					}
					return b
				}
				b.d = c.classify(b) // its limit fired first: it timed out
			} else if b.resp != nil && len(live) > 0 && !b.hold() {
				// Set aside below, the answer stays one while the others
				// run, unless its limit fired first: it timed out.
				b.d = c.classify(b)
			}
			switch {
			case len(live) == 0 && held == nil:
				return b
			case len(live) == 0 && b.resp == nil:
				c.discard(b)
				return held // an answer is better than an error
			case len(live) == 0:
				c.discard(held)
				return b
			case b.resp != nil:
				if held != nil {
					c.discard(held)
				}
				held, failed = b, true
			default:
				c.discard(b)
				failed = true
			}
		case <-timer.C:
			if h := c.hedge(ctx, len(live)); h != nil {
				live = append(live, h)
				go c.fly(h)
			}
		}
		// The next hedge, if one may go: delay after the youngest attempt
		// in flight started.
		timer.Stop()
		if !failed && c.canHedge(ctx, len(live)) {
			timer.Reset(time.Until(live[len(live)-1].start.Add(delay)))
		}
	}
}

// canHedge is the pure decision whether inFlight attempts get a hedge now
// (decide.Hedge).
func (c *call) canHedge(ctx context.Context, inFlight int) bool {
	return decide.Hedge(c.maxAttempts, max(1, c.t.cfg.hedge.MaxHedges), decide.HedgeInput{
		Sent: c.sent, InFlight: inFlight, Canceled: ctx.Err() != nil, Stopped: c.noHedge,
		Now: time.Now(), Deadline: c.overall,
	})
}

// hedge decides, commits and begins a hedge of the inFlight attempts, or
// returns nil. The commit step is a retry's (commit): the body rewound from
// GetBody, then the budget asked, last, at a transient retry's cost. A
// denial, a body that cannot be rewound and a preparation that fails each
// end the call's hedging, never an attempt in flight; the preparation's
// cost is given back.
func (c *call) hedge(ctx context.Context, inFlight int) *attempt {
	if !c.canHedge(ctx, inFlight) {
		return nil
	}
	grant, _ := c.commit(decide.Result{}, time.Now())
	if grant.Stop != "" {
		c.noHedge = true
		return nil
	}
	h, err := c.begin(ctx, "", true)
	if err != nil {
		decide.Refund(c.bud, time.Now(), grant.Cost)
		c.noHedge = true
		h.close(time.Time{})
		h.d, h.err = retry.Decision{Class: retry.ClassNotRetryable}, err
		c.observe(h, OutcomeDiscarded, decide.Result{})
		return nil
	}
	h.cost = grant.Cost
	return h
}

// settle ends a round that an attempt won: the attempts in live lose, and
// the answer held is discarded. Each loser is canceled, and the round waits
// for it to end (a base transport that honours the request's context, as
// net/http's does, returns at once), closes it without reading its outcome
// and tells the observers. It returns what a loser panicked with, nil when
// none did.
func (c *call) settle(live []*attempt, held *attempt) (panicked any) {
	for _, l := range live {
		if c.est != nil {
			c.est.add(time.Since(l.start)) // at least that long: the estimate's tail
		}
		l.cancel(errLost)
	}
	if held != nil {
		c.discard(held)
	}
	for range live {
		l := <-c.fl.results
		l.close(time.Time{})
		if panicked == nil {
			panicked = l.panicked
		}
		c.observe(l, OutcomeLost, decide.Result{})
	}
	return panicked
}

// discard tells the AttemptDone observers that attempt a is discarded and
// closes it. An answer's body is drained on a goroutine of its own, for at
// most maxPeekTime and maxDrain bytes, so that the loop waits for the
// attempts still in flight, or returns, at once; the drain ends sooner when
// the call's flight ends (flight.end).
func (c *call) discard(a *attempt) {
	c.observe(a, OutcomeDiscarded, decide.Result{})
	if a.resp == nil {
		a.close(time.Time{})
		return
	}
	c.fl.draining = append(c.fl.draining, a)
	c.fl.drains.Go(func() { a.close(time.Now().Add(maxPeekTime)) })
}
