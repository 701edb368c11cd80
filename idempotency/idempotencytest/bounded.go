package idempotencytest

import (
	"errors"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// TestBoundedStore checks, in addition to TestStore, the contract of a store
// that holds a bounded number of records (memstore.Store does): newStore
// returns an empty store that has room for capacity records and no fewer
// (register any cleanup with t.Cleanup). Such a store fails closed: a claim
// that would create a record when it is full returns an error wrapping
// idempotency.ErrStoreFull and changes nothing; it never makes room by
// dropping a record in progress (abandoned ones included) or a completed one
// within its replay window; claims of existing records (replays, takeovers,
// the Completer's), completions, recovery points and releases go on working
// when it is full; and a completed record past its replay window, a release
// or a DeleteBefore makes room again, with no Reaper running in between.
func TestBoundedStore(t *testing.T, newStore func(t *testing.T, capacity int) idempotency.Store) {
	t.Helper()
	tests := []struct {
		name     string
		capacity int
		fn       func(t *testing.T, s idempotency.Store)
	}{
		{"FullRefusesNewKeysOnly", 3, testFullRefusesNewKeysOnly},
		{"FullKeepsRecordsInProgress", 2, testFullKeepsInProgress},
		{"FullKeepsCompletedWithinWindow", 2, testFullKeepsWithinWindow},
		{"ExpiredRecordsMakeRoom", 2, testExpiredMakeRoom},
		{"ReleaseAndDeleteMakeRoom", 1, testReleaseMakesRoom},
		{"ReclaimAfterWindowWhenFull", 1, testReclaimWhenFull},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, tc.capacity)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			tc.fn(t, s)
		})
	}
}

// wantFull claims c and requires ErrStoreFull, with nothing created.
func wantFull(t *testing.T, s idempotency.Store, c idempotency.Claim) {
	t.Helper()
	res, err := s.Claim(ctx(t), c)
	if !errors.Is(err, idempotency.ErrStoreFull) {
		t.Fatalf("Claim(%q) on a full store: outcome %v, err %v; want ErrStoreFull", c.Scope.Key,
			res.Outcome, err)
	}
	if res.Outcome != idempotency.ClaimExisting || res.Record.State != idempotency.Absent {
		t.Fatalf("Claim(%q) failing with ErrStoreFull returned outcome %v, state %v", c.Scope.Key,
			res.Outcome, res.Record.State)
	}
	if _, err := s.Get(ctx(t), c.Scope); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get(%q) after a refused claim: err %v, want ErrNotFound", c.Scope.Key, err)
	}
}

// fill claims keys at now, completing each at now when complete.
func fill(t *testing.T, s idempotency.Store, now time.Time, complete bool,
	keys ...string) []idempotency.Record {
	t.Helper()
	var recs []idempotency.Record
	for _, k := range keys {
		rec := mustClaim(t, s, claimOf(scope(k), "o-"+k, "fp", now), idempotency.ClaimCreated)
		if complete {
			noErr(t, "Complete "+k, s.Complete(ctx(t), rec.Lease(), response(k), now))
		}
		recs = append(recs, rec)
	}
	return recs
}

func testFullRefusesNewKeysOnly(t *testing.T, s idempotency.Store) {
	recs := fill(t, s, at(0), false, "a", "b", "c")
	wantFull(t, s, claimOf(scope("d"), "d", "fp", at(1)))

	// Everything on the records it holds goes on.
	if got := mustClaim(t, s, claimOf(scope("a"), "x", "fp", at(1)),
		idempotency.ClaimExisting); got.Owner != "o-a" {
		t.Fatalf("a live claim of a full store's record: owner %q", got.Owner)
	}
	if got := mustClaim(t, s, claimOf(scope("a"), "x", "other-fp", at(1)),
		idempotency.ClaimExisting); got.Fingerprint != "fp" {
		t.Fatalf("a claim with another fingerprint changed the record: fp %q", got.Fingerprint)
	}
	noErr(t, "Complete on a full store", s.Complete(ctx(t), recs[0].Lease(), response("a"), at(2)))
	if got := mustClaim(t, s, claimOf(scope("a"), "x", "fp", at(3)),
		idempotency.ClaimExisting); got.State != idempotency.Completed {
		t.Fatalf("replay claim on a full store: state %v", got.State)
	}
	wantResponse(t, mustGet(t, s, scope("a")), response("a"))
	noErr(t, "SetRecoveryPoint on a full store", s.SetRecoveryPoint(ctx(t), recs[1].Lease(),
		"order", []byte("data"), at(3)))
	noErr(t, "Heartbeat on a full store", s.Heartbeat(ctx(t), recs[1].Lease(), at(3).Add(lease)))
	took := mustClaim(t, s, claimOf(scope("c"), "y", "fp", at(20)),
		idempotency.ClaimTakenOver) // c's lease ended at 10 s
	if took.Generation != recs[2].Generation+1 {
		t.Fatalf("takeover on a full store: generation %d, want %d", took.Generation,
			recs[2].Generation+1)
	}
	completer := claimOf(scope("b"), "completer", "fp", at(100))
	completer.Request, completer.ReplayWindow, completer.TakeoverOnly = nil, 0, true
	if got := mustClaim(t, s, completer, idempotency.ClaimTakenOver); got.RecoveryPoint != "order" {
		t.Fatalf("the completer's takeover on a full store: recovery point %q", got.RecoveryPoint)
	}
	wantFull(t, s, claimOf(scope("d"), "d", "fp", at(100)))
	absent := claimOf(scope("e"), "completer", "fp", at(100))
	absent.TakeoverOnly = true
	if res, err := s.Claim(ctx(t), absent); err != nil ||
		res.Outcome != idempotency.ClaimExisting || res.Record.State != idempotency.Absent {
		t.Fatalf("TakeoverOnly claim of an absent key on a full store: outcome %v state %v err "+
			"%v; want existing, absent, nil",
			res.Outcome, res.Record.State, err)
	}
}

// Records in progress, their leases long over, are abandoned work for a
// Completer or a person: a full store refuses new keys rather than drop one.
func testFullKeepsInProgress(t *testing.T, s idempotency.Store) {
	recs := fill(t, s, at(0), false, "a", "b")
	late := at(0).Add(1000 * window)
	wantFull(t, s, claimOf(scope("c"), "c", "fp", late))
	for _, rec := range recs {
		if got := mustGet(t, s, rec.Scope); got.State != idempotency.InProgress ||
			got.Owner != rec.Owner {
			t.Fatalf("%s on a full store: state %v owner %q", rec.Scope.Key, got.State, got.Owner)
		}
	}
	mustClaim(t, s, claimOf(scope("a"), "a2", "fp", late),
		idempotency.ClaimTakenOver) // and a retry takes it over
}

// A completed record is replayed for its whole window (CompletedAt + window
// >= now), however full the store.
func testFullKeepsWithinWindow(t *testing.T, s idempotency.Store) {
	fill(t, s, at(1), true, "a", "b")
	edge := at(1).Add(window) // the last instant of the window
	wantFull(t, s, claimOf(scope("c"), "c", "fp", edge))
	for _, k := range []string{"a", "b"} {
		if got := mustClaim(t, s, claimOf(scope(k), "x", "fp", edge),
			idempotency.ClaimExisting); got.State != idempotency.Completed {
			t.Fatalf("%s at the end of its window on a full store: state %v", k, got.State)
		}
		wantResponse(t, mustGet(t, s, scope(k)), response(k))
	}
}

// A completed record past its window makes room for a new key by itself:
// no Reaper runs.
func testExpiredMakeRoom(t *testing.T, s idempotency.Store) {
	fill(t, s, at(1), true, "a")
	fill(t, s, at(5), true, "b")
	now := at(1).Add(window + time.Second) // a expired, b not
	c := mustClaim(t, s, claimOf(scope("c"), "c", "fp", now), idempotency.ClaimCreated)
	if c.Generation != 1 {
		t.Fatalf("new key c: generation %d", c.Generation)
	}
	wantResponse(t, mustGet(t, s, scope("b")), response("b"))
	wantFull(t, s, claimOf(scope("d"), "d", "fp", now)) // b within its window, c in progress
	if got := mustGet(t, s, scope("c")); got.State != idempotency.InProgress {
		t.Fatalf("c after a refused claim: state %v", got.State)
	}
	later := at(5).Add(window + time.Second) // b expired too
	mustClaim(t, s, claimOf(scope("d"), "d", "fp", later), idempotency.ClaimCreated)
	if got := mustGet(t, s, scope("c")); got.State != idempotency.InProgress {
		t.Fatalf("c, in progress, after making room: state %v", got.State)
	}
}

func testReleaseMakesRoom(t *testing.T, s idempotency.Store) {
	a := fill(t, s, at(0), false, "a")[0]
	wantFull(t, s, claimOf(scope("b"), "b", "fp", at(1)))
	noErr(t, "Release", s.Release(ctx(t), a.Lease()))
	b := mustClaim(t, s, claimOf(scope("b"), "b", "fp", at(1)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), b.Lease(), response("b"), at(1)))
	wantFull(t, s, claimOf(scope("c"), "c", "fp", at(2)))
	sw, ok := s.(idempotency.Sweeper)
	if !ok {
		return // no DeleteBefore to make room
	}
	n, err := sw.DeleteBefore(ctx(t), at(2), 10) // the Reaper's call
	noErr(t, "DeleteBefore", err)
	if n != 1 {
		t.Fatalf("DeleteBefore deleted %d, want 1", n)
	}
	mustClaim(t, s, claimOf(scope("c"), "c", "fp", at(2)), idempotency.ClaimCreated)
}

// A key reused after its window takes the place of its own expired record.
func testReclaimWhenFull(t *testing.T, s idempotency.Store) {
	fill(t, s, at(1), true, "a")
	got := mustClaim(t, s, claimOf(scope("a"), "a2", "other-fp", at(1).Add(window+time.Second)),
		idempotency.ClaimCreated)
	if got.State != idempotency.InProgress || got.Owner != "a2" || got.Fingerprint != "other-fp" {
		t.Fatalf("reclaim after the window on a full store: state %v owner %q fp %q", got.State,
			got.Owner, got.Fingerprint)
	}
}
