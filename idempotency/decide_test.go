package idempotency

import (
	"testing"
	"time"
)

// decide says what a call does after a claim or a read of its record,
// from that record alone: every state, at the edges of the lease and of
// the wait, and with the claims used up.
func TestDecide(t *testing.T) {
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	alive := Record{State: InProgress, LeaseUntil: now}           // alive up to LeaseUntil inclusive
	expired := Record{State: InProgress, LeaseUntil: now.Add(-1)} // LeaseUntil < now
	done := Record{State: Completed}
	for _, tc := range []struct {
		name      string
		acquired  bool
		rec       Record
		same      bool
		waitUntil time.Time
		claims    int
		want      verdict
	}{
		{"the claim holds it", true, Record{State: InProgress}, true, now, 1, verdictRun},
		{"completed by the same request", false, done, true, now, 1, verdictReplay},
		{"completed by another", false, done, false, now, 1, verdictReused},
		{"in progress for another", false, alive, false, now.Add(time.Hour), 1, verdictReused},
		{"alive, no time to wait", false, alive, true, now, 1, verdictBusy},
		{"alive, time to wait", false, alive, true, now.Add(time.Nanosecond), 1, verdictWait},
		{"expired: take it over", false, expired, true, now, 1, verdictClaim},
		{"expired, claims used up, time to wait", false, expired, true, now.Add(time.Second),
			maxClaims, verdictWait},
		{"expired, claims used up", false, expired, true, now, maxClaims, verdictBusy},
		{"released: claim again", false, Record{}, false, now, 2, verdictClaim},
		{"released, claims used up", false, Record{}, false, now, maxClaims, verdictBusy},
	} {
		if got := decide(tc.acquired, tc.rec, tc.same, now, tc.waitUntil, tc.claims); got != tc.want {
			t.Errorf("%s: decide = %d, want %d", tc.name, got, tc.want)
		}
	}
}
