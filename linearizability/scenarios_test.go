package linearizability

import (
	"context"
	"math"
	"testing"

	"github.com/anishathalye/porcupine"
)

// Scenarios are fixed sequences of calls at the contract's edges, run one
// after the other on every store and checked against the same model as the
// concurrent histories: each is a deterministic reproduction.

// scenario builds its calls; at(n) is the time n ms after the run's epoch.
type scenario struct {
	name  string
	calls func(at func(int64) int64) []input
}

var scenarios = []scenario{
	{"a lease is alive up to and including LeaseUntil", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 10*ms, 0),
			sClaim("b", at(110), 10*ms, 0), // LeaseUntil == Now: alive
			sClaim("b", at(111), 10*ms, 0), // taken over, generation 2
			{Op: opComplete, Owner: "a", Gen: 1, Now: at(112), Resp: response{Status: 201, Body: "a"}},
			{Op: opComplete, Owner: "b", Gen: 2, Now: at(113), Resp: response{Status: 201, Body: "b"}},
			{Op: opGet},
		}
	}},
	{"a completed record restarts strictly past the window", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 10*ms, 50*ms),
			{Op: opComplete, Owner: "a", Gen: 1, Now: at(105), Resp: response{Status: 200, Body: "a"}},
			sClaim("b", at(155), 10*ms, 50*ms), // CompletedAt == Now - window: replayed
			sClaim("b", at(156), 10*ms, 50*ms), // restarted, generation 2
			{Op: opGet},
		}
	}},
	{"the same owner's stale generation is fenced off", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 1*ms, 0),
			sClaim("a", at(105), 10*ms, 0), // its own expired lease, taken over: generation 2
			{Op: opSetPoint, Owner: "a", Gen: 1, Now: at(106), Point: "stale"},
			{Op: opHeartbeat, Owner: "a", Gen: 1, Until: at(200)},
			{Op: opComplete, Owner: "a", Gen: 1, Now: at(107), Resp: response{Status: 200, Body: "stale"}},
			{Op: opRelease, Owner: "a", Gen: 1},
			{Op: opGet},
		}
	}},
	{"release, then a claim creates generation 1 again", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 10*ms, 0),
			{Op: opRelease, Owner: "a", Gen: 1},
			{Op: opGet},
			sClaim("b", at(101), 10*ms, 0),
			{Op: opGet},
		}
	}},
	{"a takeover-only claim never creates nor restarts", func(at func(int64) int64) []input {
		tko := func(in input) input { in.TakeoverOnly = true; return in }
		return []input{
			tko(sClaim("a", at(100), 10*ms, 5*ms)),
			{Op: opGet},
			sClaim("a", at(101), 10*ms, 5*ms),
			{Op: opComplete, Owner: "a", Gen: 1, Now: at(102), Resp: response{Status: 200, Body: "a"}},
			tko(sClaim("b", at(200), 10*ms, 5*ms)),
		}
	}},
	{"another fingerprint never takes over", func(at func(int64) int64) []input {
		other := sClaim("b", at(120), 10*ms, 0)
		other.FP = "fp-b"
		return []input{sClaim("a", at(100), 10*ms, 0), other, {Op: opGet}}
	}},
	// A clock that stepped back: the lease ends before the record was
	// created, and a claim at exactly CreatedAt takes it over, keeping its
	// recovery point.
	{"a takeover at CreatedAt keeps the recovery point", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 10*ms, 0),
			{Op: opSetPoint, Owner: "a", Gen: 1, Now: at(101), Point: "charged", Data: "ch_1"},
			{Op: opHeartbeat, Owner: "a", Gen: 1, Until: at(50)},
			sClaim("b", at(100), 10*ms, 0),
			{Op: opGet},
		}
	}},
	{"a heartbeat into the past lets a takeover in", func(at func(int64) int64) []input {
		return []input{
			sClaim("a", at(100), 10*ms, 0),
			{Op: opHeartbeat, Owner: "a", Gen: 1, Until: at(99)},
			sClaim("b", at(101), 10*ms, 0),
			{Op: opGet},
		}
	}},
}

func sClaim(owner string, now, lease, window int64) input {
	return input{Op: opClaim, Owner: owner, Now: now, LeaseFor: lease, Window: window, FP: "fp-a",
		Request: "req-" + owner}
}

// TestScenarios runs every scenario on every store.
func TestScenarios(t *testing.T) {
	for _, sc := range stores {
		t.Run(sc.name, func(t *testing.T) {
			b := sc.open(t)
			for _, s := range scenarios {
				t.Run(s.name, func(t *testing.T) {
					clk := newClock()
					c := caller{b.store, "scenario-" + randHex(4)}
					var ops []porcupine.Operation
					latest := int64(math.MinInt64) // the latest claim's Now so far
					for i, in := range s.calls(func(n int64) int64 { return clk.at(n) }) {
						in.Key = "k"
						call := monotonic()
						out, err := c.do(context.Background(), in)
						ret := monotonic()
						if err != nil {
							t.Fatalf("call %d, %s: %v", i, in.Op, err)
						}
						if in.Op == opClaim {
							latest = max(latest, in.Now)
						}
						out.Upper = latest
						ops = append(ops, porcupine.Operation{
							ClientId: 0, Input: in, Call: call, Output: out, Return: ret})
					}
					requireLinearizable(t, model{evicts: b.evicts, epoch: clk.epoch}, ops)
				})
			}
		})
	}
}
