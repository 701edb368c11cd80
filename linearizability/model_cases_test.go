package linearizability

import (
	"math"
	"testing"

	"github.com/anishathalye/porcupine"

	"github.com/saferetry/saferetry/idempotency"
)

// The model against hand-written histories: what it must accept and what it
// must reject, so that a store history it accepts means something.

const ms = int64(1e6)

// step is one call of a hand-written history: [call, ret] in arbitrary
// units; ret < 0 means it never returned.
type step struct {
	call, ret int64
	in        input
	out       output
}

func ops(steps ...step) []porcupine.Operation {
	out := make([]porcupine.Operation, len(steps))
	for i, s := range steps {
		ret := s.ret
		if ret < 0 {
			ret, s.out.Unknown = math.MaxInt64, true
		}
		if s.in.Key == "" {
			s.in.Key = "k"
		}
		out[i] = porcupine.Operation{ClientId: i, Input: s.in, Call: s.call, Output: s.out, Return: ret}
	}
	return out
}

// seq makes the steps sequential, one after the other; a step whose output
// is unknown never returns.
func seq(steps ...step) []porcupine.Operation {
	for i := range steps {
		steps[i].call, steps[i].ret = int64(10*i), int64(10*i+5)
		if steps[i].out.Unknown {
			steps[i].ret = -1
		}
	}
	return ops(steps...)
}

func claimIn(owner string, now, lease int64) input {
	return input{Op: opClaim, Owner: owner, Now: now * ms, LeaseFor: lease * ms, FP: "fp-a",
		Request: "req-" + owner}
}

func created(owner string, gen, now, lease int64) output {
	return output{Outcome: idempotency.ClaimCreated, Rec: view{
		ScopeOK: true, State: idempotency.InProgress, Owner: owner, Gen: gen, FP: "fp-a", FPV: 1,
		LeaseUntil: (now + lease) * ms, CreatedAt: now * ms,
	}}
}

func takenOver(owner string, gen, now, lease, createdAt int64, req string) output {
	o := created(owner, gen, now, lease)
	o.Outcome = idempotency.ClaimTakenOver
	o.Rec.CreatedAt, o.Rec.Request = createdAt*ms, req
	return o
}

func existing(owner string, gen, leaseUntil int64) output {
	return output{Outcome: idempotency.ClaimExisting, Rec: view{
		ScopeOK: true, State: idempotency.InProgress, Owner: owner, Gen: gen, FP: "fp-a", FPV: 1,
		LeaseUntil: leaseUntil * ms,
	}}
}

func write(op opKind, owner string, gen, now int64) input {
	in := input{Op: op, Owner: owner, Gen: gen, Now: now * ms}
	if op == opComplete {
		in.Resp = response{Status: 201, Body: "done-" + owner}
	}
	return in
}

var (
	ok        = output{}
	leaseLost = output{Err: errLeaseLost}
	notFound  = output{Err: errNotFound}
	get       = input{Op: opGet}
)

func completedView(owner string, gen, leaseUntil, createdAt, at int64) output {
	return output{Rec: view{
		ScopeOK: true, State: idempotency.Completed, Owner: owner, Gen: gen, FP: "fp-a", FPV: 1,
		LeaseUntil: leaseUntil * ms, CreatedAt: createdAt * ms, CompletedAt: at * ms,
		HasResp: true, Resp: response{Status: 201, Body: "done-" + owner},
	}}
}

func TestModel(t *testing.T) {
	window := func(in input, w int64) input { in.Window = w * ms; return in }
	cases := []struct {
		name   string
		evicts bool
		ops    []porcupine.Operation
		want   porcupine.CheckResult
	}{
		{"a lease is alive up to and including LeaseUntil; a takeover bumps the generation", false, seq(
			step{in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{in: claimIn("b", 10, 10), out: existing("a", 1, 10)},
			step{in: claimIn("b", 11, 10), out: takenOver("b", 2, 11, 10, 0, "req-a")},
			step{in: write(opComplete, "a", 1, 12), out: leaseLost},
			step{in: write(opComplete, "b", 2, 13), out: ok},
			step{in: get, out: completedView("b", 2, 21, 0, 13)},
		), porcupine.Ok},
		{"a takeover at LeaseUntil is rejected", false, seq(
			step{in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{in: claimIn("b", 10, 10), out: takenOver("b", 2, 10, 10, 0, "req-a")},
		), porcupine.Illegal},
		{"two sequential creations of one key are rejected", false, seq(
			step{in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{in: claimIn("b", 1, 10), out: created("b", 1, 1, 10)},
		), porcupine.Illegal},
		{"two overlapping creations of one key are rejected", false, ops(
			step{call: 0, ret: 10, in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{call: 1, ret: 9, in: claimIn("b", 1, 10), out: created("b", 1, 1, 10)},
		), porcupine.Illegal},
		{"a write with a stale generation of the same owner is rejected", false, seq(
			step{in: claimIn("a", 0, 1), out: created("a", 1, 0, 1)},
			step{in: claimIn("a", 5, 10), out: takenOver("a", 2, 5, 10, 0, "req-a")},
			step{in: write(opComplete, "a", 1, 6), out: ok},
		), porcupine.Illegal},
		{"a takeover keeps the recovery point; a lost one is rejected", false, seq(
			step{in: claimIn("a", 0, 1), out: created("a", 1, 0, 1)},
			step{in: input{Op: opSetPoint, Owner: "a", Gen: 1, Now: 1 * ms, Point: "p1", Data: "d"},
				out: ok},
			step{in: claimIn("b", 5, 10), out: takenOver("b", 2, 5, 10, 0, "req-a")}, // no point
		), porcupine.Illegal},
		{"release makes the record absent; the next claim starts at generation 1", false, seq(
			step{in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{in: write(opRelease, "a", 1, 0), out: ok},
			step{in: get, out: notFound},
			step{in: claimIn("b", 2, 10), out: created("b", 1, 2, 10)},
			step{in: write(opRelease, "a", 1, 0), out: leaseLost},
		), porcupine.Ok},
		{"a claim with an unknown outcome may have happened", false, seq(
			step{in: claimIn("a", 0, 10), out: output{Unknown: true}},
			step{in: claimIn("b", 1, 10), out: existing("a", 1, 10)},
		), porcupine.Ok},
		{"a claim with an unknown outcome may not have happened", false, seq(
			step{in: claimIn("a", 0, 10), out: output{Unknown: true}},
			step{in: claimIn("b", 1, 10), out: created("b", 1, 1, 10)},
		), porcupine.Ok},
		{"a call that never returned may take effect later", false, ops(
			step{call: 0, ret: -1, in: write(opComplete, "a", 1, 3)},
			step{call: 1, ret: 2, in: claimIn("a", 1, 10), out: created("a", 1, 1, 10)},
			step{call: 4, ret: 5, in: get, out: completedView("a", 1, 11, 1, 3)},
		), porcupine.Ok},
		{"a call that returned cannot take effect after its return", false, ops(
			step{call: 0, ret: 2, in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{call: 3, ret: 4, in: get, out: notFound},
		), porcupine.Illegal},
		{"past the replay window a claim restarts the record with the next generation", false, seq(
			step{in: window(claimIn("a", 0, 10), 5), out: created("a", 1, 0, 10)},
			step{in: write(opComplete, "a", 1, 2), out: ok},
			step{in: window(claimIn("b", 7, 10), 5), out: output{Outcome: idempotency.ClaimExisting,
				Rec: completedView("a", 1, 10, 0, 2).Rec}},
			step{in: window(claimIn("b", 8, 10), 5), out: created("b", 2, 8, 10)},
		), porcupine.Ok},
		{"a store that keeps records cannot start over at generation 1", false, seq(
			step{in: window(claimIn("a", 0, 10), 5), out: created("a", 1, 0, 10)},
			step{in: write(opComplete, "a", 1, 2), out: ok},
			step{in: window(claimIn("b", 8, 10), 5), out: created("b", 1, 8, 10)},
		), porcupine.Illegal},
		{"a store that evicts may start over at generation 1 past the window", true, ops(
			step{call: 0, ret: 1, in: window(claimIn("a", 0, 10), 5), out: created("a", 1, 0, 10)},
			step{call: 2, ret: 3, in: write(opComplete, "a", 1, 2), out: ok},
			step{call: 4, ret: 5, in: get, out: output{Err: errNotFound, Upper: 8 * ms}},
			step{call: 6, ret: 7, in: window(claimIn("b", 8, 10), 5), out: created("b", 1, 8, 10)},
		), porcupine.Ok},
		{"a store that evicts keeps a record within its window", true, ops(
			step{call: 0, ret: 1, in: window(claimIn("a", 0, 10), 5), out: created("a", 1, 0, 10)},
			step{call: 2, ret: 3, in: write(opComplete, "a", 1, 2), out: ok},
			step{call: 4, ret: 5, in: get, out: output{Err: errNotFound, Upper: 7 * ms}},
		), porcupine.Illegal},
		{"a different fingerprint never takes over", false, seq(
			step{in: claimIn("a", 0, 1), out: created("a", 1, 0, 1)},
			step{in: input{Op: opClaim, Owner: "b", Now: 5 * ms, LeaseFor: ms, FP: "fp-b"},
				out: takenOver("b", 2, 5, 1, 0, "req-a")},
		), porcupine.Illegal},
		{"takeover-only never creates", false, seq(
			step{in: input{Op: opClaim, Owner: "a", Now: 0, LeaseFor: ms, FP: "fp-a", TakeoverOnly: true},
				out: output{Outcome: idempotency.ClaimExisting}},
			step{in: get, out: notFound},
		), porcupine.Ok},
		{"heartbeats move the lease both ways", false, seq(
			step{in: claimIn("a", 0, 10), out: created("a", 1, 0, 10)},
			step{in: input{Op: opHeartbeat, Owner: "a", Gen: 1, Until: 30 * ms}, out: ok},
			step{in: claimIn("b", 20, 10), out: existing("a", 1, 30)},
			step{in: input{Op: opHeartbeat, Owner: "a", Gen: 1, Until: 21 * ms}, out: ok},
			step{in: claimIn("b", 22, 10), out: takenOver("b", 2, 22, 10, 0, "req-a")},
		), porcupine.Ok},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := model{evicts: c.evicts}
			if got := check(m, c.ops).result; got != c.want {
				t.Fatalf("porcupine says %s, want %s", got, c.want)
			}
		})
	}
}
