package saferetry

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/internal/latency"
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

// errLost is the cause of the context of an attempt that another attempt
// of its call won against.
var errLost = errors.New("saferetry: another attempt won")

// hedging is a call's hedged rounds: whether it may hedge no more, the
// host's latency estimate, the outcomes of the attempts in flight at once,
// and the drains of the answers its rounds discarded. A call that does not
// hedge has none (nil).
type hedging struct {
	c     *call
	delay time.Duration     // the fixed delay; 0 for the adaptive one
	est   *latency.Estimate // the host's estimate; nil for a fixed delay
	// stopped is true once the call may hedge no more: pushback, a
	// Retry-After, the budget, a body or a preparation that failed.
	stopped bool

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

// newHedging returns the call's hedging, or nil when the call may not be
// hedged: only a request that may be sent again whatever its outcome (see
// the package documentation), a POST or PATCH only when it has a key, which
// every hedge carries, so that the server answers all but one with the
// in-progress conflict or the replay. Its body must be replayable, and it
// must be allowed more than one attempt.
func (c *call) newHedging(method string) *hedging {
	cfg := &c.t.cfg
	if cfg.hedge.MaxHedges < 0 || !c.idempotent || c.maxAttempts < 2 || c.notRetrying != "" ||
		(c.body != nil && c.body != http.NoBody && c.getBody == nil) {
		return nil
	}
	if (method == http.MethodPost || method == http.MethodPatch) && c.key == "" {
		return nil
	}
	h := &hedging{c: c, delay: cfg.hedge.Delay}
	if c.t.est != nil {
		h.est = c.t.est.For(c.req.URL.Host)
	}
	return h
}

// round runs one round of attempts: a, and the hedges sent beside it each
// time the attempts in flight have gone the hedge delay without response
// headers. It returns the attempt the loop judges next, with no other
// attempt of the round left in flight:
//   - the first final answer (one the loop would not retry), handed over:
//     the attempts still in flight lose (settle), and any answer set aside
//     is discarded;
//   - otherwise, once every attempt has ended, the last retryable answer,
//     or, when none came, the last outcome, an error.
//
// Without a delay (the call may hedge no more, or the host's estimate has
// too few answers), a is sent alone. A retryable answer or an error that
// comes while other attempts are in flight is set aside (the last answer,
// its time limit stopped: the others' limits bound the wait) or discarded,
// and the round waits for the others: a hedge never makes the caller's
// answer worse. A hedge answers slowness, not failure: once an attempt of
// the round has failed, the round sends no more hedges, and what follows
// it is a retry, after its backoff. Every discarded answer is drained
// (bounded) and closed; every attempt of the round but the one returned is
// told to the AttemptDone observers, as lost or discarded.
func (h *hedging) round(ctx context.Context, a *attempt) *attempt {
	delay, ok := h.nextDelay()
	if !ok {
		h.c.roundTrip(a)
		h.heard(a)
		return a
	}
	if h.results == nil {
		h.results = make(chan *attempt)
	}
	live := append(make([]*attempt, 0, 2), a)
	go h.fly(a)
	timer := time.NewTimer(delay)
	defer timer.Stop()
	var (
		held   *attempt // the last retryable answer, set aside
		failed bool     // an attempt of the round failed: no more hedges, a retry backs off
	)
	for {
		select {
		case b := <-h.results:
			live = slices.DeleteFunc(live, func(x *attempt) bool { return x == b })
			if b.panicked != nil {
				h.settle(live, held)
				b.close(time.Time{})
				panic(b.panicked)
			}
			h.heard(b)
			if b.resp != nil && (!b.d.Retry || hop.Marked(b.resp)) {
				if h.c.handOver(b) {
					if p := h.settle(live, held); p != nil {
						b.resp.Body.Close()
						panic(p)
					}
					return b
				}
				b.d = h.c.classify(b) // its limit fired first: it timed out
			} else if b.resp != nil && len(live) > 0 && !b.hold() {
				// Set aside below, the answer stays one while the others
				// run, unless its limit fired first: it timed out.
				b.d = h.c.classify(b)
			}
			switch {
			case len(live) == 0 && held == nil:
				return b
			case len(live) == 0 && b.resp == nil:
				h.discard(b)
				return held // an answer is better than an error
			case len(live) == 0:
				h.discard(held)
				return b
			case b.resp != nil:
				if held != nil {
					h.discard(held)
				}
				held, failed = b, true
			default:
				h.discard(b)
				failed = true
			}
		case <-timer.C:
			if x := h.hedge(ctx, len(live)); x != nil {
				live = append(live, x)
				go h.fly(x)
			}
		}
		// The next hedge, if one may go: delay after the youngest attempt
		// in flight started.
		timer.Stop()
		if !failed && h.may(ctx, len(live)) {
			timer.Reset(time.Until(live[len(live)-1].start.Add(delay)))
		}
	}
}

// nextDelay returns the hedge delay of the call's next round, and false
// when the round is not hedged: the call may hedge no more, or the host's
// adaptive estimate has too few answers yet.
func (h *hedging) nextDelay() (time.Duration, bool) {
	switch {
	case h.stopped:
		return 0, false
	case h.delay > 0:
		return h.delay, true
	}
	return h.est.P95()
}

// heard takes note of attempt a's outcome, whether or not its round is
// hedged: its latency feeds the host's adaptive estimate, and an answer
// with the mark "retried below" or a Retry-After ends the call's hedging
// (never hedge after pushback).
func (h *hedging) heard(a *attempt) {
	if h.est != nil && a.resp != nil {
		h.est.Add(a.answered.Sub(a.sendStart()))
	}
	if hop.Marked(a.resp) || a.d.HasRetryAfter {
		h.stopped = true
	}
}

// may is the pure decision whether inFlight attempts get a hedge now
// (decide.Hedge).
func (h *hedging) may(ctx context.Context, inFlight int) bool {
	c := h.c
	return decide.Hedge(c.maxAttempts, max(1, c.t.cfg.hedge.MaxHedges), decide.HedgeInput{
		Sent: int(c.sent.Load()), InFlight: inFlight, Canceled: ctx.Err() != nil, Stopped: h.stopped,
		Now: time.Now(), Deadline: c.overall,
	})
}

// hedge decides, commits and begins a hedge of the inFlight attempts, or
// returns nil. The commit step is a retry's (commit): the body rewound from
// GetBody, then the budget asked, last, at a transient retry's cost. A
// denial, a body that cannot be rewound and a preparation that fails each
// end the call's hedging, never an attempt in flight; the cost of a hedge
// never sent goes back to the budget when the call ends (finish).
func (h *hedging) hedge(ctx context.Context, inFlight int) *attempt {
	c := h.c
	if !h.may(ctx, inFlight) {
		return nil
	}
	grant, _ := c.commit(decide.Result{}, time.Now())
	if grant.Stop != "" {
		h.stopped = true
		return nil
	}
	c.unsent += grant.Cost
	x, err := c.begin(ctx, "", true, grant.Cost)
	if err != nil {
		h.stopped = true
		x.close(time.Time{})
		x.d, x.err = retry.Decision{Class: retry.ClassNotRetryable}, err
		c.observe(x, OutcomeDiscarded, decide.Result{}, time.Now())
		return nil
	}
	return x
}

// fly sends attempt a on its own goroutine and hands its outcome to the
// round. A panic of the base transport or of a rule is handed over too, and
// raised again on the goroutine of RoundTrip, as it would be without
// hedging.
func (h *hedging) fly(a *attempt) {
	defer func() {
		a.panicked = recover()
		h.results <- a
	}()
	h.c.roundTrip(a)
}

// settle ends a round that an attempt won: the attempts in live lose, and
// the answer held is discarded. Each loser is canceled, and the round waits
// for it to end (a base transport that honours the request's context, as
// net/http's does, returns at once), closes it without reading its outcome
// and tells the observers. It returns what a loser panicked with, nil when
// none did.
func (h *hedging) settle(live []*attempt, held *attempt) (panicked any) {
	for _, l := range live {
		if h.est != nil {
			h.est.Add(time.Since(l.start)) // at least that long: the estimate's tail
		}
		l.cancel(errLost)
	}
	if held != nil {
		h.discard(held)
	}
	for range live {
		l := <-h.results
		l.close(time.Time{})
		if panicked == nil {
			panicked = l.panicked
		}
		h.c.observe(l, OutcomeLost, decide.Result{}, time.Now())
	}
	return panicked
}

// discard tells the AttemptDone observers that attempt a is discarded and
// closes it. An answer's body is drained on a goroutine of its own, for at
// most maxPeekTime and maxDrain bytes, so that the round waits for the
// attempts still in flight, or returns, at once; the drain ends sooner when
// the hedging ends (end).
func (h *hedging) discard(a *attempt) {
	h.c.observe(a, OutcomeDiscarded, decide.Result{}, time.Now())
	if a.resp == nil {
		a.close(time.Time{})
		return
	}
	h.draining = append(h.draining, a)
	h.drains.Go(func() { a.close(time.Now().Add(maxPeekTime)) })
}

// end ends the drains still running and waits for them. h may be nil (the
// call does not hedge). Safe to call more than once.
func (h *hedging) end() {
	if h == nil {
		return
	}
	for _, a := range h.draining {
		a.cancel(nil)
	}
	h.drains.Wait()
}
