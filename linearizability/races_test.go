package linearizability

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// Focused races: two workers on one key, one changing the record while the
// other claims it, for as many rounds as it takes to hit the moment between
// a claim's decision and its answer. Each is a reproduction of one race; the
// history is checked like any other.

// raceRounds bounds each race; raceLimit bounds it in time.
const (
	raceRounds = 3000
	raceLimit  = 3 * time.Second
)

// TestClaimRaces runs each race on every store.
func TestClaimRaces(t *testing.T) {
	races := []struct {
		name string
		// writer changes the record; claimer claims it. Both get the
		// round's key and the clock's current time.
		writer, claimer func(c caller, rec sink, key string, now int64)
	}{
		// A takeover-only claim (the Completer's) racing a record that is
		// created and released again: the claim must take the record over
		// or find none, never answer "existing" with a record it would
		// have taken over.
		{"takeover-only claim against create and release", createRelease, takeoverOnly},
		// A claim racing a heartbeat that ends the lease: it must take
		// the record over (the lease ended) or find it alive, never answer
		// "existing" with the ended lease.
		{"claim against end lease", endLease, claimLater},
	}
	for _, sc := range stores {
		t.Run(sc.name, func(t *testing.T) {
			b := sc.open(t)
			for _, r := range races {
				t.Run(r.name, func(t *testing.T) {
					clk, h := newClock(), &history{}
					c := caller{b.store, "race-" + randHex(4)}
					deadline := time.Now().Add(raceLimit)
					for i := 0; i < raceRounds && time.Now().Before(deadline); i++ {
						key := fmt.Sprintf("k%d", i)
						now := clk.at(clk.tick.Add(10))
						var wg sync.WaitGroup
						wg.Go(func() { r.writer(c, h, key, now) })
						wg.Go(func() { r.claimer(c, h, key, now) })
						wg.Wait()
					}
					requireLinearizable(t, model{evicts: b.evicts, epoch: clk.epoch}, h.operations())
				})
			}
		})
	}
}

// rcall makes one call and records it.
func rcall(c caller, rec sink, client int, in input) output {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	call := rec.begin(client, in)
	out, _ := c.do(ctx, in) // no replay window: Upper does not matter
	rec.end(call, out)
	return out
}

const lease = int64(time.Hour)

// createRelease creates the record, releases it and creates it again.
func createRelease(c caller, rec sink, key string, now int64) {
	for range 2 {
		in := input{Op: opClaim, Key: key, Owner: "a", Now: now, LeaseFor: lease, FP: "fp-a"}
		if out := rcall(c, rec, 0, in); out.Outcome == idempotency.ClaimCreated {
			rcall(c, rec, 0, input{Op: opRelease, Key: key, Owner: "a", Gen: out.Rec.Gen})
		}
	}
}

// takeoverOnly claims, takeover only, from far enough in the future that
// every lease has ended, and releases what it took over.
func takeoverOnly(c caller, rec sink, key string, now int64) {
	for range 3 {
		in := input{Op: opClaim, Key: key, Owner: "b", Now: now + 2*lease, LeaseFor: lease,
			FP: "fp-a", TakeoverOnly: true}
		if out := rcall(c, rec, 1, in); out.Outcome == idempotency.ClaimTakenOver {
			rcall(c, rec, 1, input{Op: opRelease, Key: key, Owner: "b", Gen: out.Rec.Gen})
		}
	}
}

// endLease creates the record and ends its lease at once (a heartbeat to now).
func endLease(c caller, rec sink, key string, now int64) {
	in := input{Op: opClaim, Key: key, Owner: "a", Now: now, LeaseFor: lease, FP: "fp-a"}
	if out := rcall(c, rec, 0, in); out.Outcome == idempotency.ClaimCreated {
		rcall(c, rec, 0, input{Op: opHeartbeat, Key: key, Owner: "a", Gen: out.Rec.Gen, Until: now})
	}
}

// claimLater claims a moment after the record's creation, while its lease
// is alive unless it was ended.
func claimLater(c caller, rec sink, key string, now int64) {
	for range 3 {
		in := input{Op: opClaim, Key: key, Owner: "b", Now: now + 1, LeaseFor: lease, FP: "fp-a"}
		if out := rcall(c, rec, 1, in); out.Outcome != idempotency.ClaimExisting {
			return
		}
	}
}
