package main

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"time"

	"github.com/saferetry/saferetry/jitter"
)

// Strategy is one way of waiting between retries in the contention
// experiment.
type Strategy struct {
	Name string
	Func jitter.Func // nil: retry at once, no backoff
}

// Strategies are the five compared in Brooker's post, in the order of its
// charts, using this module's jitter formulas.
var Strategies = []Strategy{
	{Name: "No backoff", Func: nil},
	{Name: "Exponential (no jitter)", Func: jitter.None},
	{Name: "Equal jitter", Func: jitter.Equal},
	{Name: "Full jitter", Func: jitter.Full},
	{Name: "Decorrelated jitter", Func: jitter.Decorrelated},
}

// Indexes into Strategies, for the checks.
const (
	stratNone = iota
	stratExpo
	stratEqual
	stratFull
	stratDecorr
)

// OCCConfig configures the optimistic-concurrency contention experiment.
type OCCConfig struct {
	Clients   []int         // contention levels (N clients each)
	Runs      int           // runs averaged per level and strategy
	Seed      uint64        // root of every run's random stream
	Base, Cap time.Duration // backoff base and cap: 5 ms and 2000 ms
	DelayMean time.Duration // one-way network delay: |Normal(10 ms, 2 ms)|
	DelaySD   time.Duration
	Workers   int // goroutines running simulations; <= 0: GOMAXPROCS
}

// DefaultOCCConfig returns the parameters of Brooker's post: N = 10 to 190
// step 10, 100 runs each, base 5 ms, cap 2 s, delay |Normal(10 ms, 2 ms)|.
func DefaultOCCConfig(seed uint64) OCCConfig {
	var ns []int
	for n := 10; n <= 190; n += 10 {
		ns = append(ns, n)
	}
	return OCCConfig{
		Clients: ns, Runs: 100, Seed: seed,
		Base: 5 * time.Millisecond, Cap: 2000 * time.Millisecond,
		DelayMean: 10 * time.Millisecond, DelaySD: 2 * time.Millisecond,
	}
}

// OCCRow is the result at one contention level: per strategy (indexed like
// Strategies), the mean number of write calls per run and the mean time until
// the last client succeeded.
type OCCRow struct {
	Clients int
	Calls   []float64
	Time    []time.Duration
}

// Event kinds of the contention experiment: the four messages of one
// read-then-write attempt.
const (
	occReadAtServer  = iota // a client's read reaches the server
	occReadReply            // the version read reaches the client (val)
	occWriteAtServer        // a write conditioned on version val reaches the server
	occWriteReply           // the outcome reaches the client (val 1: success)
)

// simulateOCC runs one round of Brooker's experiment: n clients start at
// time 0, each reads the row's version and then writes with the version read;
// the server accepts a write only when the version has not moved since, and
// bumps it. A client whose write fails waits (network delay plus backoff) and
// starts over with a new read. It returns the number of write calls the
// server received and the time the last client learned of its success.
//
// The model follows Brooker's simulator (aws-samples/aws-arch-backoff-simulator)
// message by message; in particular his clients count failures from 1 and
// back off for expo(attempt) = min(cap, base*2^attempt) after failure number
// attempt, so the first retry waits up to 2*base. The same exponent is passed
// to the jitter functions here, to reproduce his figures.
func simulateOCC(n int, f jitter.Func, c OCCConfig, rng *rand.Rand) (calls int, end time.Duration) {
	net := newNetwork(c.DelayMean, c.DelaySD, rng)
	attempt := make([]int, n)
	prev := make([]time.Duration, n)
	q := &queue{ev: make([]event, 0, 2*n)}
	for i := range n {
		q.push(event{at: net.delay(), who: int32(i), kind: occReadAtServer})
	}
	var version int64
	for q.len() > 0 {
		e := q.pop()
		t := e.at
		switch e.kind {
		case occReadAtServer:
			q.push(event{at: t + net.delay(), who: e.who, kind: occReadReply, val: version})
		case occReadReply:
			q.push(event{at: t + net.delay(), who: e.who, kind: occWriteAtServer, val: e.val})
		case occWriteAtServer:
			calls++
			ok := int64(0)
			if e.val == version {
				version++
				ok = 1
			}
			q.push(event{at: t + net.delay(), who: e.who, kind: occWriteReply, val: ok})
		case occWriteReply:
			end = t
			if e.val == 1 {
				continue // this client is done
			}
			i := e.who
			attempt[i]++
			var wait time.Duration
			if f != nil {
				wait = f(attempt[i], prev[i], c.Base, c.Cap, rng.Float64())
				prev[i] = wait
			}
			q.push(event{at: t + net.delay() + wait, who: i, kind: occReadAtServer})
		}
	}
	return calls, end
}

// RunOCC runs the contention experiment: every level, strategy and run, in
// parallel, each run with its own random stream, so the result does not
// depend on scheduling.
func RunOCC(c OCCConfig) []OCCRow {
	workers := c.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	rows := make([]OCCRow, len(c.Clients))
	for i, n := range c.Clients {
		rows[i] = OCCRow{Clients: n, Calls: make([]float64, len(Strategies)), Time: make([]time.Duration, len(Strategies))}
	}
	type job struct{ level, strat int }
	jobs := make(chan job)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				n := c.Clients[j.level]
				var calls, total int64
				for run := range c.Runs {
					rng := rand.New(rand.NewPCG(c.Seed, stream(1, uint64(j.strat), uint64(n), uint64(run))))
					k, end := simulateOCC(n, Strategies[j.strat].Func, c, rng)
					calls += int64(k)
					total += int64(end)
				}
				// Each job owns its own cells: no lock needed.
				rows[j.level].Calls[j.strat] = float64(calls) / float64(c.Runs)
				rows[j.level].Time[j.strat] = time.Duration(total / int64(c.Runs))
			}
		}()
	}
	// Largest levels first: they take longest, so the pool stays busy.
	for level := len(c.Clients) - 1; level >= 0; level-- {
		for s := range Strategies {
			jobs <- job{level, s}
		}
	}
	close(jobs)
	wg.Wait()
	return rows
}
