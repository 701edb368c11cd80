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

// Policy is a retry budget configuration of the outage experiment. New
// returns the budget of one client instance (each process has its own, as
// with the Transport's per-process registry).
type Policy struct {
	Name string
	New  func() budget.Budget
}

// Policies are compared in the outage experiment: no budget, the default
// token bucket and the ratio budget, all the real types of package budget.
var Policies = []Policy{
	{Name: "no budget", New: budget.Unlimited},
	{Name: "token bucket (default)", New: func() budget.Budget { return budget.NewTokenBucket(budget.TokenBucketConfig{}) }},
	{Name: "ratio 20% + floor", New: func() budget.Budget { return budget.NewRatio(budget.RatioConfig{}) }},
}

// OutageConfig configures the outage experiment.
type OutageConfig struct {
	Clients       int           // client instances in the fleet, each with its own budget
	RatePerClient float64       // logical requests per second per instance (Poisson arrivals)
	Duration      time.Duration // new logical requests arrive during [0, Duration)
	OutageStart   time.Duration // the server answers 503 to everything in [OutageStart, OutageEnd)
	OutageEnd     time.Duration
	Seed          uint64
	DelayMean     time.Duration // one-way network delay |Normal(mean, sd)|
	DelaySD       time.Duration

	// The client loop, as the Transport's defaults: 3 attempts, full jitter
	// (base 50 ms, cap 20 s), 30 s overall.
	MaxAttempts int
	Backoff     jitter.Config
	MaxElapsed  time.Duration
}

// DefaultOutageConfig returns 20 instances sending 50 requests/s each
// (1000/s in all) for 60 s, with a full outage from 10 s to 30 s.
func DefaultOutageConfig(seed uint64) OutageConfig {
	return OutageConfig{
		Clients: 20, RatePerClient: 50, Duration: 60 * time.Second,
		OutageStart: 10 * time.Second, OutageEnd: 30 * time.Second,
		Seed: seed, DelayMean: 10 * time.Millisecond, DelaySD: 2 * time.Millisecond,
		MaxAttempts: decide.DefaultMaxAttempts, Backoff: jitter.Config{}, MaxElapsed: decide.DefaultMaxElapsed,
	}
}

// OutageResult is the outcome of one policy.
type OutageResult struct {
	Policy    string
	Requests  int // logical requests
	Hits      int // attempts that reached the server
	Succeeded int // logical requests that ended with a success
	// Requests whose first attempt reached the server during the outage,
	// and all the attempts those requests made.
	OutageRequests, OutageHits int
	PerSecond                  []int // attempts reaching the server in each second
	Logical                    []int // logical requests starting in each second
}

// Amplification is server hits per logical request over the whole run.
func (r OutageResult) Amplification() float64 { return ratio(r.Hits, r.Requests) }

// OutageAmplification is attempts per logical request for the requests that
// met the outage on their first attempt.
func (r OutageResult) OutageAmplification() float64 { return ratio(r.OutageHits, r.OutageRequests) }

// SuccessRate is the share of logical requests that succeeded.
func (r OutageResult) SuccessRate() float64 { return ratio(r.Succeeded, r.Requests) }

// PeakDuringOutage is the largest number of hits in one second of the outage.
func (r OutageResult) PeakDuringOutage(c OutageConfig) int {
	peak := 0
	for s := int(c.OutageStart / time.Second); s < int(c.OutageEnd/time.Second) && s < len(r.PerSecond); s++ {
		peak = max(peak, r.PerSecond[s])
	}
	return peak
}

func ratio(a, b int) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// Event kinds of the outage experiment.
const (
	outArrival  = iota // client who starts a new logical request
	outAtServer        // attempt of request who reaches the server
	outReply           // the answer to request who reaches its client (val 1: success)
)

// request is the retry loop state of one logical request.
type request struct {
	client    int32
	start     time.Duration
	attempt   int // attempts sent so far
	prevWait  time.Duration
	retryCost int
	outage    bool // its first attempt met the outage
}

// unavailable is how the Transport classifies the outage's answer, a 503
// without Retry-After to a request that may be repeated.
var unavailable = retry.Decision{Retry: true, Class: "status_503"}

// epoch is the simulated wall clock at time 0 of a run; budgets see
// epoch+t as now.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// RunOutage simulates the fleet under each policy with the same arrivals,
// network delays and jitter streams, so that only the budget differs.
func RunOutage(c OutageConfig) []OutageResult {
	out := make([]OutageResult, len(Policies))
	for i, p := range Policies {
		out[i] = simulateOutage(c, p)
	}
	return out
}

func simulateOutage(c OutageConfig, p Policy) OutageResult {
	// Separate streams: every policy sees the same arrivals (one stream per
	// client); network delays and jitter draws stay aligned until the
	// policies' decisions differ.
	net := newNetwork(c.DelayMean, c.DelaySD, rand.New(rand.NewPCG(c.Seed, stream(2, 1))))
	jit := rand.New(rand.NewPCG(c.Seed, stream(2, 2)))
	arrivals := make([]*rand.Rand, c.Clients)
	for i := range arrivals {
		arrivals[i] = rand.New(rand.NewPCG(c.Seed, stream(3, uint64(i))))
	}

	res := OutageResult{Policy: p.Name}
	seconds := int((c.Duration + c.MaxElapsed) / time.Second)
	res.PerSecond = make([]int, seconds+1)
	res.Logical = make([]int, seconds+1)
	budgets := make([]budget.Budget, c.Clients)
	for i := range budgets {
		budgets[i] = p.New()
	}
	nextArrival := func(client int32, t time.Duration) time.Duration {
		return t + time.Duration(arrivals[client].ExpFloat64()/c.RatePerClient*float64(time.Second))
	}
	failing := func(t time.Duration) bool { return t >= c.OutageStart && t < c.OutageEnd }
	count := func(series []int, t time.Duration) {
		if s := int(t / time.Second); s < len(series) {
			series[s]++
		}
	}

	loop := decide.Config{MaxAttempts: c.MaxAttempts, Backoff: c.Backoff, MaxRetryAfter: decide.DefaultMaxRetryAfter}
	var reqs []request
	q := &queue{}
	for i := range c.Clients {
		q.push(event{at: nextArrival(int32(i), 0), who: int32(i), kind: outArrival})
	}
	for q.len() > 0 {
		e := q.pop()
		t := e.at
		now := epoch.Add(t)
		switch e.kind {
		case outArrival:
			if t >= c.Duration {
				continue
			}
			q.push(event{at: nextArrival(e.who, t), who: e.who, kind: outArrival})
			res.Requests++
			count(res.Logical, t)
			decide.Begin(budgets[e.who], now)
			reqs = append(reqs, request{client: e.who, start: t, attempt: 1})
			q.push(event{at: t + net.delay(), who: int32(len(reqs) - 1), kind: outAtServer})
		case outAtServer:
			r := &reqs[e.who]
			res.Hits++
			count(res.PerSecond, t)
			ok := int64(1)
			if failing(t) {
				ok = 0
			}
			if r.attempt == 1 && ok == 0 {
				r.outage = true
				res.OutageRequests++
			}
			if r.outage {
				res.OutageHits++
			}
			q.push(event{at: t + net.delay(), who: e.who, kind: outReply, val: ok})
		case outReply:
			r := &reqs[e.who]
			b := budgets[r.client]
			if e.val == 1 {
				decide.End(b, now, http.StatusOK, r.retryCost)
				res.Succeeded++
				continue
			}
			// The Transport's own decision and its commit step, the same
			// functions.
			step := decide.Grant(b, now, decide.Decide(loop, decide.Input{
				Outcome: unavailable, Attempt: r.attempt, Now: now,
				Deadline: epoch.Add(r.start + c.MaxElapsed), PrevWait: r.prevWait,
				Rand: jit.Float64,
			}))
			if step.Stop != "" {
				decide.End(b, now, http.StatusServiceUnavailable, r.retryCost)
				continue
			}
			r.retryCost, r.prevWait = step.Cost, step.Wait
			r.attempt++
			q.push(event{at: t + step.Wait + net.delay(), who: e.who, kind: outAtServer})
		}
	}
	res.PerSecond = trimZeros(res.PerSecond)
	res.Logical = res.Logical[:min(len(res.Logical), len(res.PerSecond))]
	return res
}

// trimZeros drops the trailing seconds in which nothing reached the server.
func trimZeros(s []int) []int {
	n := len(s)
	for n > 0 && s[n-1] == 0 {
		n--
	}
	return s[:n]
}
