package idempotencytest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
)

// claimUnitTests are the subtests of a ClaimTransactor's ClaimInUnit.
var claimUnitTests = []suiteTest{
	{"ClaimInUnitCommit", testClaimInUnitCommit, needsClaimTransactor},
	{"ClaimInUnitRollback", testClaimInUnitRollback, needsClaimTransactor},
	{"ClaimInUnitLeavesWinsToClaim", testClaimInUnitWins, needsClaimTransactor},
}

// claimInUnit calls ClaimInUnit with no wait and requires no error.
func claimInUnit(t *testing.T, s idempotency.Store, c idempotency.Claim) (
	idempotency.ClaimResult, idempotency.Unit) {
	t.Helper()
	res, u, _, err := s.(idempotency.ClaimTransactor).ClaimInUnit(ctx(t), c, 0)
	noErr(t, "ClaimInUnit("+c.Scope.Key+")", err)
	if (u != nil) != res.Acquired() {
		t.Fatalf("ClaimInUnit(%q): outcome %v with unit %v", c.Scope.Key, res.Outcome, u)
	}
	return res, u
}

// A fresh key's record exists for nobody else until the unit commits; then
// it is completed with the unit's response, under the claim's owner and
// generation 1, and a claim in a unit of it answers as Claim: existing.
func testClaimInUnitCommit(t *testing.T, s idempotency.Store) {
	sc := scope("unit-commit")
	c := claimOf(sc, "owner-1", "fp", at(0))
	res, u := claimInUnit(t, s, c)
	rec := res.Record
	if res.Outcome != idempotency.ClaimCreated || rec.State != idempotency.InProgress ||
		rec.Owner != c.Owner || rec.Generation != 1 || rec.Fingerprint != c.Fingerprint {
		t.Fatalf("ClaimInUnit: %v state %v owner %q gen %d fp %q; want created, in progress, "+
			"the claim's owner and fingerprint, generation 1", res.Outcome, rec.State,
			rec.Owner, rec.Generation, rec.Fingerprint)
	}
	wantTime(t, "ClaimInUnit: LeaseUntil", rec.LeaseUntil, c.Now.Add(c.LeaseFor))
	if _, err := s.Get(ctx(t), sc); !errors.Is(err, idempotency.ErrNotFound) {
		_ = u.Rollback()
		t.Fatalf("Get before the unit's commit: %v, want ErrNotFound", err)
	}
	resp := idempotency.Response{Status: 201, Body: []byte("made in one unit")}
	noErr(t, "Unit.Complete", u.Complete(ctx(t), resp, at(1)))
	noErr(t, "Unit.Commit", u.Commit())
	got := mustGet(t, s, sc)
	if got.State != idempotency.Completed || got.Owner != c.Owner || got.Generation != 1 ||
		got.Response == nil || got.Response.Status != 201 ||
		!bytes.Equal(got.Response.Body, resp.Body) {
		t.Fatalf("after Commit: state %v owner %q gen %d response %+v; want completed by the "+
			"claim with its response", got.State, got.Owner, got.Generation, got.Response)
	}
	wantTime(t, "after Commit: CompletedAt", got.CompletedAt, at(1))

	again, u2 := claimInUnit(t, s, claimOf(sc, "owner-2", "fp", at(2)))
	if again.Outcome != idempotency.ClaimExisting || u2 != nil ||
		again.Record.State != idempotency.Completed || again.Record.Owner != c.Owner {
		t.Fatalf("ClaimInUnit of a completed key: %v state %v owner %q; want existing, the "+
			"completed record", again.Outcome, again.Record.State, again.Record.Owner)
	}
	other, _ := claimInUnit(t, s, claimOf(sc, "owner-3", "other-fp", at(3)))
	if other.Outcome != idempotency.ClaimExisting || other.Record.Fingerprint != "fp" {
		t.Fatalf("ClaimInUnit with another fingerprint: %v fp %q; want existing, fp %q",
			other.Outcome, other.Record.Fingerprint, "fp")
	}
}

// A rolled-back unit leaves no record: the key is claimed afresh.
func testClaimInUnitRollback(t *testing.T, s idempotency.Store) {
	sc := scope("unit-rollback")
	_, u := claimInUnit(t, s, claimOf(sc, "owner-1", "fp", at(0)))
	noErr(t, "Unit.Complete", u.Complete(ctx(t), idempotency.Response{Status: 200}, at(1)))
	noErr(t, "Unit.Rollback", u.Rollback())
	if _, err := s.Get(ctx(t), sc); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get after Rollback: %v, want ErrNotFound", err)
	}
	res, u2 := claimInUnit(t, s, claimOf(sc, "owner-2", "fp", at(2)))
	if res.Outcome != idempotency.ClaimCreated || res.Record.Generation != 1 {
		t.Fatalf("ClaimInUnit after Rollback: %v gen %d; want created, generation 1",
			res.Outcome, res.Record.Generation)
	}
	noErr(t, "Unit.Rollback", u2.Rollback())
}

// A record the claim would take over (an expired lease) or restart (a
// completion past the replay window) is left to Claim: a zero Record and
// no unit; ClaimInUnit changes nothing of it.
func testClaimInUnitWins(t *testing.T, s idempotency.Store) {
	expired := scope("unit-expired")
	first := mustClaim(t, s, claimOf(expired, "owner-1", "fp", at(0)), idempotency.ClaimCreated)
	late := at(0).Add(lease + window)
	res, u := claimInUnit(t, s, claimOf(expired, "owner-2", "fp", late))
	if res.Outcome != idempotency.ClaimExisting || u != nil ||
		res.Record.State != idempotency.Absent {
		t.Fatalf("ClaimInUnit of an expired lease: %v state %v; want existing with a zero record",
			res.Outcome, res.Record.State)
	}
	if got := mustGet(t, s, expired); got.Owner != first.Owner || got.Generation != first.Generation {
		t.Fatalf("after ClaimInUnit: owner %q gen %d; want unchanged %q %d", got.Owner,
			got.Generation, first.Owner, first.Generation)
	}

	done := scope("unit-window")
	rec := mustClaim(t, s, claimOf(done, "owner-1", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), rec.Lease(), idempotency.Response{Status: 200}, at(1)))
	res, u = claimInUnit(t, s, claimOf(done, "owner-2", "fp", at(2).Add(2*window)))
	if res.Outcome != idempotency.ClaimExisting || u != nil ||
		res.Record.State != idempotency.Absent {
		t.Fatalf("ClaimInUnit past the replay window: %v state %v; want existing with a zero "+
			"record", res.Outcome, res.Record.State)
	}
	if got := mustGet(t, s, done); got.State != idempotency.Completed {
		t.Fatalf("after ClaimInUnit: state %v; want completed, unchanged", got.State)
	}
}
