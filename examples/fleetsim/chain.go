package main

import (
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// ChainVariant is one configuration of the chain experiment: the budget of
// every instance of every retrying tier, and whether the services push back
// (deadline.Middleware marks a failed answer whose failure was retried
// below, and callers never retry a marked answer).
type ChainVariant struct {
	Name     string
	Budget   func() budget.Budget
	Pushback bool
}

func tokenBucket() budget.Budget { return budget.NewTokenBucket(budget.TokenBucketConfig{}) }

// ChainVariants are compared in the chain experiment.
var ChainVariants = []ChainVariant{
	{Name: "naive (no budget)", Budget: budget.Unlimited},
	{Name: "pushback, no budget", Budget: budget.Unlimited, Pushback: true},
	{Name: "budgets (default)", Budget: tokenBucket},
	{Name: "budgets + pushback", Budget: tokenBucket, Pushback: true},
}

// ChainConfig configures the chain experiment: a fleet of clients calls a
// tier of services, which calls a second tier (Middle tiers in all), which
// calls the bottom tier. The clients and the middle tiers retry with the
// Transport's own decision; the bottom fails every request in [FullStart,
// HalfStart) and half of them, at random, in [HalfStart, HalfEnd).
type ChainConfig struct {
	Clients       int     // client instances, each with its own budget
	RatePerClient float64 // user requests per second per client (Poisson arrivals)
	// Middle is the number of middle tiers (0: the clients call the bottom)
	// and Instances the number of instances of each, each with its own
	// budget (as each process has its own).
	Middle    int
	Instances int
	Duration  time.Duration // user requests arrive during [0, Duration)
	FullStart time.Duration
	HalfStart time.Duration
	HalfEnd   time.Duration
	Seed      uint64
	DelayMean time.Duration // one-way network delay of every hop |Normal(mean, sd)|
	DelaySD   time.Duration
	// Steady is the length of the window over which the steady state of a
	// phase is measured: the window that ends Steady before the phase ends,
	// so that its user requests, retries included, end within the phase.
	Steady time.Duration

	// Every retrying tier's loop, as the Transport's defaults: 3 attempts,
	// full jitter (base 50 ms, cap 20 s), 30 s overall.
	MaxAttempts int
	Backoff     jitter.Config
	MaxElapsed  time.Duration
}

// DefaultChainConfig returns 20 clients sending 25 requests/s each (500/s
// in all) through two middle tiers of 5 instances each, for 50 s: healthy until
// 5 s, a full outage of the bottom from 5 s to 25 s, a 50% outage from 25 s
// to 45 s, healthy again to the end.
func DefaultChainConfig(seed uint64) ChainConfig {
	return ChainConfig{
		Clients: 20, RatePerClient: 25, Middle: 2, Instances: 5, Duration: 50 * time.Second,
		FullStart: 5 * time.Second, HalfStart: 25 * time.Second, HalfEnd: 45 * time.Second,
		Seed: seed, DelayMean: 10 * time.Millisecond, DelaySD: 2 * time.Millisecond,
		Steady:      5 * time.Second,
		MaxAttempts: decide.DefaultMaxAttempts, Backoff: jitter.Config{}, MaxElapsed: decide.DefaultMaxElapsed,
	}
}

// ChainResult is the outcome of one variant.
type ChainResult struct {
	Variant string
	Users   []int // user requests arriving in each second
	// Bottom counts, per second of arrival, the requests that the user
	// requests arriving in that second made reach the bottom.
	Bottom []int
	// Succeeded counts, per second of arrival, the user requests that ended
	// in a success.
	Succeeded []int
}

// Amplification is the bottom's requests per user request, for the user
// requests arriving in each second.
func (r ChainResult) Amplification() []float64 {
	a := make([]float64, len(r.Users))
	for s := range a {
		a[s] = ratio(r.Bottom[s], r.Users[s])
	}
	return a
}

// Over returns the bottom's requests per user request over [from, to).
func (r ChainResult) Over(from, to time.Duration) float64 {
	return ratio(sum(r.Bottom, from, to), sum(r.Users, from, to))
}

// Peak is the largest amplification of one second in [from, to).
func (r ChainResult) Peak(from, to time.Duration) float64 {
	peak := 0.0
	a := r.Amplification()
	for s := int(from / time.Second); s < int(to/time.Second) && s < len(a); s++ {
		peak = max(peak, a[s])
	}
	return peak
}

// SuccessRate is the share of the user requests arriving in [from, to)
// that succeeded.
func (r ChainResult) SuccessRate(from, to time.Duration) float64 {
	return ratio(sum(r.Succeeded, from, to), sum(r.Users, from, to))
}

func sum(series []int, from, to time.Duration) int {
	n := 0
	for s := int(from / time.Second); s < int(to/time.Second) && s < len(series); s++ {
		n += series[s]
	}
	return n
}

// SteadyWindow returns the window over which the steady state of the
// phase ending at end is measured.
func (c ChainConfig) SteadyWindow(end time.Duration) (from, to time.Duration) {
	return end - 2*c.Steady, end - c.Steady
}

// ChainSummary is what the chain experiment reports of one variant.
type ChainSummary struct {
	Variant string
	// Peak is the largest amplification of a second of arrivals during the
	// outage, full or 50%; FullSteady and HalfSteady the steady states.
	Peak, FullSteady, HalfSteady float64
	// HalfSuccess is the share of the user requests of the 50% outage's
	// steady window that succeeded.
	HalfSuccess float64
}

// Summary returns the figures of r.
func (c ChainConfig) Summary(r ChainResult) ChainSummary {
	fullFrom, fullTo := c.SteadyWindow(c.HalfStart)
	halfFrom, halfTo := c.SteadyWindow(c.HalfEnd)
	return ChainSummary{Variant: r.Variant, Peak: r.Peak(c.FullStart, c.HalfEnd),
		FullSteady: r.Over(fullFrom, fullTo), HalfSteady: r.Over(halfFrom, halfTo),
		HalfSuccess: r.SuccessRate(halfFrom, halfTo)}
}

// RunChain simulates the chain under each variant with the same arrivals.
func RunChain(c ChainConfig) []ChainResult {
	out := make([]ChainResult, len(ChainVariants))
	for i, v := range ChainVariants {
		out[i] = simulateChain(c, v)
	}
	return out
}

// RunOneLayer is the reference of the chain experiment: the same clients
// calling the bottom directly, with no budget and with the default one.
func RunOneLayer(c ChainConfig) []ChainResult {
	c.Middle = 0
	out := []ChainResult{simulateChain(c, ChainVariants[0]), simulateChain(c, ChainVariants[2])}
	out[0].Variant, out[1].Variant = "one layer, no budget", "one layer, default budget"
	return out
}

// Event kinds of the chain experiment.
const (
	chArrival  = iota // client who starts a user request
	chAtServer        // an attempt of call who reaches the tier below its caller
	chReply           // the answer to call who reaches its caller (val: chOK, chFailed or chMarked)
)

// Answers in a chReply's val.
const (
	chOK     = 0
	chFailed = 1
	chMarked = 2 // failed, marked "retried below: do not retry"
)

// chainCall is one call of a retrying tier: a user request (tier 0), or
// the call a middle tier's service makes for one request it serves.
type chainCall struct {
	tier     int8  // the caller's tier: 0 the clients, 1 to Middle the middle tiers
	inst     int32 // the caller's instance, whose budget it uses
	parent   int32 // the call whose attempt this call serves (middle tiers)
	arrival  int32 // the second the user request arrived in
	start    time.Duration
	attempt  int
	prevWait time.Duration
	cost     int
}

func simulateChain(c ChainConfig, v ChainVariant) ChainResult {
	net := newNetwork(c.DelayMean, c.DelaySD, rand.New(rand.NewPCG(c.Seed, stream(4, 1))))
	jit := rand.New(rand.NewPCG(c.Seed, stream(4, 2)))
	pick := rand.New(rand.NewPCG(c.Seed, stream(4, 3)))  // the instance an attempt reaches
	coins := rand.New(rand.NewPCG(c.Seed, stream(4, 4))) // the bottom's failures in the 50% outage
	arrivals := make([]*rand.Rand, c.Clients)
	for i := range arrivals {
		arrivals[i] = rand.New(rand.NewPCG(c.Seed, stream(5, uint64(i))))
	}
	budgets := make([][]budget.Budget, 1+c.Middle) // the clients', then each middle tier's
	for t := range budgets {
		budgets[t] = make([]budget.Budget, c.Instances)
		if t == 0 {
			budgets[t] = make([]budget.Budget, c.Clients)
		}
		for i := range budgets[t] {
			budgets[t][i] = v.Budget()
		}
	}
	seconds := int(c.Duration/time.Second) + 1
	res := ChainResult{Variant: v.Name, Users: make([]int, seconds), Bottom: make([]int, seconds),
		Succeeded: make([]int, seconds)}
	count := func(series []int, t time.Duration) {
		if s := int(t / time.Second); s < len(series) {
			series[s]++
		}
	}
	bottomFails := func(t time.Duration) bool {
		switch {
		case t >= c.FullStart && t < c.HalfStart:
			return true
		case t >= c.HalfStart && t < c.HalfEnd:
			return coins.Float64() < 0.5
		}
		return false
	}
	nextArrival := func(client int32, t time.Duration) time.Duration {
		return t + time.Duration(arrivals[client].ExpFloat64()/c.RatePerClient*float64(time.Second))
	}
	loop := decide.Config{MaxAttempts: c.MaxAttempts, Backoff: c.Backoff, MaxRetryAfter: decide.DefaultMaxRetryAfter}

	var calls []chainCall
	q := &queue{}
	// finish ends call i: a user request is counted; a middle tier's
	// service answers the call it served, marking a failure when it pushes
	// back.
	finish := func(i int32, t time.Duration, ok bool, stop retry.Reason, marked bool) {
		cl := &calls[i]
		if cl.tier == 0 {
			if ok {
				res.Succeeded[cl.arrival]++
			}
			return
		}
		answer := int64(chOK)
		if !ok {
			answer = chFailed
			if v.Pushback && decide.PushBack(stop, cl.attempt, http.StatusServiceUnavailable, marked) {
				answer = chMarked
			}
		}
		q.push(event{at: t + net.delay(), who: cl.parent, kind: chReply, val: answer})
	}
	for i := range c.Clients {
		q.push(event{at: nextArrival(int32(i), 0), who: int32(i), kind: chArrival})
	}
	for q.len() > 0 {
		e := q.pop()
		t := e.at
		now := epoch.Add(t)
		switch e.kind {
		case chArrival:
			if t >= c.Duration {
				continue
			}
			q.push(event{at: nextArrival(e.who, t), who: e.who, kind: chArrival})
			count(res.Users, t)
			decide.Begin(budgets[0][e.who], now)
			calls = append(calls, chainCall{tier: 0, inst: e.who, arrival: int32(t / time.Second), start: t,
				attempt: 1})
			q.push(event{at: t + net.delay(), who: int32(len(calls) - 1), kind: chAtServer})
		case chAtServer:
			cl := calls[e.who]
			if int(cl.tier) == c.Middle { // the bottom answers
				res.Bottom[cl.arrival]++
				answer := int64(chOK)
				if bottomFails(t) {
					answer = chFailed
				}
				q.push(event{at: t + net.delay(), who: e.who, kind: chReply, val: answer})
				continue
			}
			// A service of tier cl.tier+1 serves the attempt: it calls the
			// tier below, from the instance the attempt reached.
			inst := pick.Int32N(int32(c.Instances))
			decide.Begin(budgets[cl.tier+1][inst], now)
			calls = append(calls, chainCall{tier: cl.tier + 1, inst: inst, parent: e.who, arrival: cl.arrival,
				start: t, attempt: 1})
			q.push(event{at: t + net.delay(), who: int32(len(calls) - 1), kind: chAtServer})
		case chReply:
			cl := &calls[e.who]
			b := budgets[cl.tier][cl.inst]
			if e.val == chOK {
				decide.End(b, now, http.StatusOK, cl.cost)
				finish(e.who, t, true, "", false)
				continue
			}
			marked := v.Pushback && e.val == chMarked
			// The Transport's own decision and its commit step, the same
			// functions.
			step := decide.Grant(b, now, decide.Decide(loop, decide.Input{
				Outcome: unavailable, Attempt: cl.attempt, Marked: marked, Now: now,
				Deadline: epoch.Add(cl.start + c.MaxElapsed), PrevWait: cl.prevWait,
				Rand: jit.Float64,
			}))
			if step.Stop != "" {
				decide.End(b, now, http.StatusServiceUnavailable, cl.cost)
				finish(e.who, t, false, step.Stop, marked)
				continue
			}
			cl.cost, cl.prevWait = step.Cost, step.Wait
			cl.attempt++
			q.push(event{at: t + step.Wait + net.delay(), who: e.who, kind: chAtServer})
		}
	}
	return res
}
