package idempotencytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// base is the fixed "now" the Store subtests start from. Times they pass are
// whole seconds after base, so stores that keep millisecond or microsecond
// precision compare equal.
var base = time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)

const (
	lease  = 10 * time.Second
	window = time.Hour
)

// TestStore runs the conformance suite against stores made by newStore,
// which is called once per subtest and must return an empty store of the
// same type each time (register any cleanup with t.Cleanup). Its Store
// subtests use only the Store contract: they pass every time explicitly
// (whole seconds after 2025-01-02 03:04:05 UTC, which a store that expires
// records by its own clock must keep for a while) and never sleep. Its
// Middleware subtests run idempotency.New over the store at the real clock
// (and never sleep either): recovery names, a resume without credentials, a
// completion whose answer is lost, durations at their limits. Its Do
// subtests prove the function door (Middleware.Do) over the store the same
// way: replays byte for byte, scopes, conflicts, failures released, kept,
// stored or panicking, outputs over the bound, bad input, a fenced
// takeover, the Completer, and a claim whose answer was lost.
// The Unit subtests are registered only when the first store newStore
// returns is an idempotency.Transactor, and the subtests of the listings
// and of the background jobs only when it is an idempotency.Sweeper (see
// the package documentation).
func TestStore(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Helper()
	tests := []suiteTest{
		{"ClaimNew", testClaimNew, 0},
		{"ClaimRace", testClaimRace, 0},
		{"Get", testGet, 0},
		{"ScopeIsolation", testScopeIsolation, 0},
		{"InProgressAlive", testInProgressAlive, 0},
		{"CompleteAndReplay", testCompleteAndReplay, 0},
		{"ReplayWindowExpiry", testReplayWindowExpiry, 0},
		{"TakeoverSameFingerprintOnly", testTakeover, 0},
		{"Fencing", testFencing, 0},
		{"Release", testRelease, 0},
		{"Heartbeat", testHeartbeat, 0},
		{"HeartbeatEndsLease", testHeartbeatEndsLease, 0},
		{"RecoveryPointKeptAcrossTakeover", testRecoveryPoint, 0},
		{"Abandoned", testAbandoned, needsSweeper},
		{"DeleteBefore", testDeleteBefore, needsSweeper},
		{"Boundaries", testBoundaries, 0},
		{"DurationsAtTheirLimits", testDurationLimits, 0},
		{"RequestBytes", testRequestBytes, 0},
		{"CompleterClaim", testCompleterClaim, 0},
		{"ClaimTakeoverOnly", testTakeoverOnly, 0},
		{"UnitCommitVisibility", testUnitCommit, needsTransactor},
		{"UnitRollback", testUnitRollback, needsTransactor},
		{"UnitLeaseLostAtCommit", testUnitLeaseLost, needsTransactor},
		{"UnitRaceWithTakeover", testUnitRace, needsTransactor},
	}
	tests = append(tests, claimUnitTests...)
	tests = append(tests, bytesTests...)
	tests = append(tests, middlewareTests...)
	tests = append(tests, functionTests...)
	// The first store made says which subtests apply: the list runs in
	// order, and the first subtest needs nothing but a Store.
	var made bool
	var has needs
	for _, tc := range tests {
		if made && tc.needs&^has != 0 {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			got := needsOf(s)
			if !made {
				made, has = true, got
			}
			if missing := tc.needs &^ got; missing != 0 {
				t.Fatalf("newStore returned a %T, which is no %v, for subtest %s", s, missing,
					tc.name)
			}
			tc.fn(t, s)
		})
	}
}

// suiteTest is one subtest of TestStore, and what it needs of the store
// beyond idempotency.Store.
type suiteTest struct {
	name  string
	fn    func(t *testing.T, s idempotency.Store)
	needs needs
}

// needs is a set of the interfaces a store implements beyond
// idempotency.Store.
type needs uint8

const (
	needsTransactor needs = 1 << iota
	needsSweeper
	needsClaimTransactor
)

func (n needs) String() string {
	var names []string
	if n&needsTransactor != 0 {
		names = append(names, "idempotency.Transactor")
	}
	if n&needsSweeper != 0 {
		names = append(names, "idempotency.Sweeper")
	}
	if n&needsClaimTransactor != 0 {
		names = append(names, "idempotency.ClaimTransactor")
	}
	return strings.Join(names, " and ")
}

// needsOf returns the interfaces s implements beyond idempotency.Store.
func needsOf(s idempotency.Store) needs {
	var n needs
	if _, ok := s.(idempotency.Transactor); ok {
		n |= needsTransactor
	}
	if _, ok := s.(idempotency.Sweeper); ok {
		n |= needsSweeper
	}
	if _, ok := s.(idempotency.ClaimTransactor); ok {
		n |= needsClaimTransactor
	}
	return n
}

// store is a Store whose records the background jobs can list and delete.
type store interface {
	idempotency.Store
	idempotency.Sweeper
}

func at(sec int) time.Time { return base.Add(time.Duration(sec) * time.Second) }

func scope(key string) idempotency.Scope {
	return idempotency.Scope{Principal: "acct-1", Method: http.MethodPost, Route: "POST /payments",
		Key: key}
}

func claimOf(s idempotency.Scope, owner, fp string, now time.Time) idempotency.Claim {
	return idempotency.Claim{
		Scope: s, Fingerprint: fp, FingerprintVersion: 1, Owner: owner,
		Request: []byte(`{"req":"` + s.Key + `"}`), Now: now, LeaseFor: lease, ReplayWindow: window,
	}
}

func ctx(t *testing.T) context.Context { return t.Context() }

// mustClaim claims with c, requires the outcome want, and checks that the
// record holds what ClaimOutcome documents for it: the claim's own values,
// and what the store holds (read back with Get) for the fields the outcome
// sets from the record.
func mustClaim(t *testing.T, s idempotency.Store, c idempotency.Claim,
	want idempotency.ClaimOutcome) idempotency.Record {
	t.Helper()
	res, err := s.Claim(ctx(t), c)
	if err != nil {
		t.Fatalf("Claim(%q, owner %q, now %s): %v", c.Scope.Key, c.Owner, c.Now.Sub(base), err)
	}
	rec := res.Record
	if res.Outcome != want {
		t.Fatalf("Claim(%q, owner %q, now %s): outcome %v, want %v (record: state %v owner %q "+
			"gen %d)",
			c.Scope.Key, c.Owner, c.Now.Sub(base), res.Outcome, want, rec.State, rec.Owner,
			rec.Generation)
	}
	if res.Acquired() != (want != idempotency.ClaimExisting) {
		t.Fatalf("Claim(%q): Acquired() = %v for outcome %v", c.Scope.Key, res.Acquired(),
			res.Outcome)
	}
	if want == idempotency.ClaimExisting && c.TakeoverOnly && rec.State == idempotency.Absent {
		return rec // nothing to take over
	}
	stored := mustGet(t, s, c.Scope)
	what := fmt.Sprintf("Claim(%q) %v", c.Scope.Key, want)
	if rec.Scope != c.Scope || rec.Generation != stored.Generation || rec.Owner != stored.Owner ||
		rec.State != stored.State || !rec.LeaseUntil.Equal(stored.LeaseUntil) ||
		rec.Fingerprint != stored.Fingerprint ||
		rec.FingerprintVersion != stored.FingerprintVersion {
		t.Fatalf("%s: record scope %+v state %v owner %q gen %d lease %v fp %q v%d; "+
			"the store holds state %v owner %q gen %d lease %v fp %q v%d", what,
			rec.Scope, rec.State, rec.Owner, rec.Generation, rec.LeaseUntil, rec.Fingerprint,
			rec.FingerprintVersion,
			stored.State, stored.Owner, stored.Generation, stored.LeaseUntil, stored.Fingerprint,
			stored.FingerprintVersion)
	}
	if want == idempotency.ClaimExisting {
		if stored.State == idempotency.Completed {
			wantTime(t, what+": CompletedAt", rec.CompletedAt, stored.CompletedAt)
			wantResponse(t, rec, *stored.Response)
		}
		return rec
	}
	if rec.State != idempotency.InProgress || rec.Owner != c.Owner ||
		rec.Fingerprint != c.Fingerprint ||
		rec.FingerprintVersion != c.FingerprintVersion || rec.Response != nil ||
		rec.Generation < 1 {
		t.Fatalf("%s: state %v owner %q fp %q v%d gen %d response %v; want in_progress, the "+
			"claim's owner and fingerprint, no response",
			what, rec.State, rec.Owner, rec.Fingerprint, rec.FingerprintVersion, rec.Generation,
			rec.Response)
	}
	wantTime(t, what+": LeaseUntil", rec.LeaseUntil, c.Now.Add(c.LeaseFor))
	wantTime(t, what+": UpdatedAt", rec.UpdatedAt, c.Now)
	if want == idempotency.ClaimCreated {
		wantTime(t, what+": CreatedAt", rec.CreatedAt, c.Now)
		if rec.RecoveryPoint != "" || len(rec.RecoveryData) != 0 {
			t.Fatalf("%s: recovery point %q data %q, want none", what, rec.RecoveryPoint,
				rec.RecoveryData)
		}
		return rec
	}
	wantTime(t, what+": CreatedAt", rec.CreatedAt, stored.CreatedAt)
	if rec.RecoveryPoint != stored.RecoveryPoint ||
		!bytes.Equal(rec.RecoveryData, stored.RecoveryData) ||
		!bytes.Equal(rec.Request, stored.Request) {
		t.Fatalf("%s: recovery point %q data %q request %q; the store holds %q %q %q", what,
			rec.RecoveryPoint, rec.RecoveryData, rec.Request, stored.RecoveryPoint,
			stored.RecoveryData, stored.Request)
	}
	return rec
}

func mustGet(t *testing.T, s idempotency.Store, sc idempotency.Scope) idempotency.Record {
	t.Helper()
	rec, err := s.Get(ctx(t), sc)
	if err != nil {
		t.Fatalf("Get(%q): %v", sc.Key, err)
	}
	return rec
}

func wantLeaseLost(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("%s: err = %v, want ErrLeaseLost", what, err)
	}
}

func noErr(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func wantTime(t *testing.T, what string, got, want time.Time) {
	t.Helper()
	if !got.Equal(want) {
		t.Fatalf("%s = %v, want %v", what, got, want)
	}
}

func response(body string) idempotency.Response {
	return idempotency.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"},
			"Location": {"/payments/" + body}},
		Body: []byte(`{"id":"` + body + `"}`),
	}
}

func wantResponse(t *testing.T, rec idempotency.Record, want idempotency.Response) {
	t.Helper()
	if rec.Response == nil {
		t.Fatalf("record %q has no response", rec.Scope.Key)
	}
	got := *rec.Response
	if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("response = %d %q, want %d %q", got.Status, got.Body, want.Status, want.Body)
	}
	for k := range want.Header {
		if fmt.Sprint(got.Header.Values(k)) != fmt.Sprint(want.Header.Values(k)) {
			t.Fatalf("response header %s = %q, want %q", k, got.Header.Values(k),
				want.Header.Values(k))
		}
	}
	if len(got.Header) != len(want.Header) {
		t.Fatalf("response headers = %v, want %v", got.Header, want.Header)
	}
}

func testClaimNew(t *testing.T, s idempotency.Store) {
	sc := scope("new")
	rec := mustClaim(t, s, claimOf(sc, "owner-a", "fp1", at(0)), idempotency.ClaimCreated)
	if rec.Scope != sc || rec.State != idempotency.InProgress || rec.Owner != "owner-a" ||
		rec.Generation != 1 {
		t.Fatalf("new record = scope %+v state %v owner %q gen %d; want %+v in_progress owner-a 1",
			rec.Scope, rec.State, rec.Owner, rec.Generation, sc)
	}
	if rec.Fingerprint != "fp1" || rec.FingerprintVersion != 1 {
		t.Fatalf("fingerprint = %q v%d, want fp1 v1", rec.Fingerprint, rec.FingerprintVersion)
	}
	wantTime(t, "LeaseUntil", rec.LeaseUntil, at(10))
	if rec.RecoveryPoint != "" || rec.Response != nil {
		t.Fatalf("new record has recovery point %q / response %v", rec.RecoveryPoint, rec.Response)
	}
	if l := rec.Lease(); l.Owner != "owner-a" || l.Generation != 1 || l.Scope != sc {
		t.Fatalf("Lease() = %+v", l)
	}
	got := mustGet(t, s, sc)
	if got.State != idempotency.InProgress || got.Owner != "owner-a" || got.Generation != 1 {
		t.Fatalf("Get after claim: state %v owner %q gen %d", got.State, got.Owner, got.Generation)
	}
	wantTime(t, "CreatedAt", got.CreatedAt, at(0))
}

func testClaimRace(t *testing.T, s idempotency.Store) {
	const n = 64
	sc := scope("race")
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		mu      sync.Mutex
		winners []string
		owners  = map[string]int{}
		errs    []error
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			owner := fmt.Sprintf("owner-%02d", i)
			res, err := s.Claim(context.Background(), claimOf(sc, owner, "fp", at(0)))
			rec := res.Record
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case res.Outcome == idempotency.ClaimCreated:
				winners = append(winners, owner)
				owners[rec.Owner]++
			default:
				owners[rec.Owner]++
				if res.Outcome != idempotency.ClaimExisting ||
					rec.State != idempotency.InProgress || rec.Generation != 1 {
					errs = append(errs, fmt.Errorf("loser saw outcome %v state %v gen %d",
						res.Outcome, rec.State, rec.Generation))
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d of %d claims failed, first: %v", len(errs), n, errs[0])
	}
	if len(winners) != 1 {
		t.Fatalf("%d claims acquired (%v), want exactly 1", len(winners), winners)
	}
	if len(owners) != 1 || owners[winners[0]] != n {
		t.Fatalf("claims saw owners %v, want all %d to see the winner %s", owners, n, winners[0])
	}
	if rec := mustGet(t, s, sc); rec.Owner != winners[0] {
		t.Fatalf("stored owner %q, winner %q", rec.Owner, winners[0])
	}
}

func testGet(t *testing.T, s idempotency.Store) {
	_, err := s.Get(ctx(t), scope("missing"))
	if !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get of a missing scope: err = %v, want ErrNotFound", err)
	}
	mustClaim(t, s, claimOf(scope("present"), "o", "fp", at(0)), idempotency.ClaimCreated)
	if got := mustGet(t, s, scope("present")); got.Scope != scope("present") {
		t.Fatalf("Get returned scope %+v", got.Scope)
	}
	if _, err := s.Get(ctx(t), scope("missing")); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get of a missing scope after another claim: err = %v, want ErrNotFound", err)
	}
}

func testScopeIsolation(t *testing.T, s idempotency.Store) {
	base := scope("k")
	variants := []idempotency.Scope{base}
	v := base
	v.Principal = "acct-2"
	variants = append(variants, v)
	v = base
	v.Method = http.MethodPatch
	variants = append(variants, v)
	v = base
	v.Route = "POST /refunds"
	variants = append(variants, v)
	v = base
	v.Key = "k2"
	variants = append(variants, v)
	for i, sc := range variants {
		rec := mustClaim(t, s, claimOf(sc, fmt.Sprintf("o%d", i), "fp", at(0)),
			idempotency.ClaimCreated)
		if rec.Generation != 1 {
			t.Fatalf("variant %d: generation %d", i, rec.Generation)
		}
	}
	noErr(t, "Complete variant 0", s.Complete(ctx(t), idempotency.Lease{Scope: base, Owner: "o0",
		Generation: 1}, response("a"), at(1)))
	for i, sc := range variants[1:] {
		if rec := mustGet(t, s, sc); rec.State != idempotency.InProgress || rec.Response != nil {
			t.Fatalf("variant %d sees another scope's completion: %v", i+1, rec.State)
		}
	}
}

func testInProgressAlive(t *testing.T, s idempotency.Store) {
	sc := scope("alive")
	mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	for _, fp := range []string{"fp", "other"} {
		rec := mustClaim(t, s, claimOf(sc, "b", fp, at(9)), idempotency.ClaimExisting)
		if rec.Owner != "a" || rec.Generation != 1 || rec.State != idempotency.InProgress ||
			rec.Fingerprint != "fp" {
			t.Fatalf("claim with fp %q during a live lease changed the record: owner %q gen %d "+
				"state %v fp %q",
				fp, rec.Owner, rec.Generation, rec.State, rec.Fingerprint)
		}
	}
	// An expired lease with another fingerprint is not taken over either.
	rec := mustClaim(t, s, claimOf(sc, "c", "other", at(20)), idempotency.ClaimExisting)
	if rec.Owner != "a" || rec.Generation != 1 {
		t.Fatalf("claim with another fingerprint took an expired lease: owner %q gen %d", rec.Owner,
			rec.Generation)
	}
}

func testCompleteAndReplay(t *testing.T, s idempotency.Store) {
	sc := scope("complete")
	rec := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	resp := response("p1")
	noErr(t, "Complete", s.Complete(ctx(t), rec.Lease(), resp, at(2)))
	got := mustGet(t, s, sc)
	if got.State != idempotency.Completed {
		t.Fatalf("state after Complete = %v", got.State)
	}
	if got.Owner != "a" || got.Generation != 1 {
		t.Fatalf("a completed record keeps the owner and generation that completed it: owner %q "+
			"gen %d",
			got.Owner, got.Generation)
	}
	wantTime(t, "CompletedAt", got.CompletedAt, at(2))
	wantResponse(t, got, resp)
	// Within the window, even after the lease's end, a claim gets the record.
	for _, fp := range []string{"fp", "other"} {
		again := mustClaim(t, s, claimOf(sc, "b", fp, at(60)), idempotency.ClaimExisting)
		if again.State != idempotency.Completed || again.Owner != "a" || again.Generation != 1 {
			t.Fatalf("claim (fp %q) of a completed record: state %v owner %q gen %d", fp,
				again.State, again.Owner, again.Generation)
		}
		wantResponse(t, again, resp)
	}
	wantLeaseLost(t, "second Complete", s.Complete(ctx(t), rec.Lease(), response("p2"), at(3)))
	wantLeaseLost(t, "Heartbeat of a completed record", s.Heartbeat(ctx(t), rec.Lease(), at(100)))
	wantLeaseLost(t, "Release of a completed record", s.Release(ctx(t), rec.Lease()))
	wantLeaseLost(t, "SetRecoveryPoint of a completed record", s.SetRecoveryPoint(ctx(t),
		rec.Lease(), "p", nil, at(3)))
	wantResponse(t, mustGet(t, s, sc), resp)
}

func testReplayWindowExpiry(t *testing.T, s idempotency.Store) {
	sc := scope("window")
	rec := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), rec.Lease(), response("old"), at(1)))
	inside := at(1).Add(window - time.Second)
	mustClaim(t, s, claimOf(sc, "b", "fp", inside), idempotency.ClaimExisting)
	after := at(1).Add(window + time.Second)
	fresh := mustClaim(t, s, claimOf(sc, "c", "other-fp", after), idempotency.ClaimCreated)
	if fresh.State != idempotency.InProgress || fresh.Owner != "c" || fresh.Generation != 2 ||
		fresh.Fingerprint != "other-fp" {
		t.Fatalf("claim after the window: state %v owner %q gen %d fp %q; want in_progress c 2 "+
			"other-fp",
			fresh.State, fresh.Owner, fresh.Generation, fresh.Fingerprint)
	}
	if fresh.Response != nil || fresh.RecoveryPoint != "" {
		t.Fatalf("claim after the window kept the old response or recovery point")
	}
	wantLeaseLost(t, "old owner's Complete after the window", s.Complete(ctx(t), rec.Lease(),
		response("x"), after))
	noErr(t, "new owner's Complete", s.Complete(ctx(t), fresh.Lease(), response("new"), after))
	wantResponse(t, mustGet(t, s, sc), response("new"))
}

func testTakeover(t *testing.T, s idempotency.Store) {
	sc := scope("takeover")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	mustClaim(t, s, claimOf(sc, "x", "other", at(11)), idempotency.ClaimExisting)
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(11)), idempotency.ClaimTakenOver)
	if b.Owner != "b" || b.Generation != a.Generation+1 || b.State != idempotency.InProgress {
		t.Fatalf("takeover: owner %q gen %d state %v; want b %d in_progress", b.Owner, b.Generation,
			b.State, a.Generation+1)
	}
	wantTime(t, "LeaseUntil after takeover", b.LeaseUntil, at(21))
	got := mustGet(t, s, sc)
	if got.Owner != "b" || got.Generation != 2 {
		t.Fatalf("Get after takeover: owner %q gen %d", got.Owner, got.Generation)
	}
	// B's lease is alive: nobody takes it over.
	mustClaim(t, s, claimOf(sc, "c", "fp", at(20)), idempotency.ClaimExisting)
	// Once it expires, the next takeover bumps again.
	c := mustClaim(t, s, claimOf(sc, "c", "fp", at(22)), idempotency.ClaimTakenOver)
	if c.Generation != 3 {
		t.Fatalf("second takeover generation %d, want 3", c.Generation)
	}
}

func testFencing(t *testing.T, s idempotency.Store) {
	sc := scope("fencing")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(11)), idempotency.ClaimTakenOver)
	old := a.Lease()
	wantLeaseLost(t, "old Heartbeat", s.Heartbeat(ctx(t), old, at(100)))
	wantLeaseLost(t, "old SetRecoveryPoint", s.SetRecoveryPoint(ctx(t), old, "late", []byte("x"),
		at(12)))
	wantLeaseLost(t, "old Complete", s.Complete(ctx(t), old, response("A"), at(12)))
	wantLeaseLost(t, "old Release", s.Release(ctx(t), old))
	// Same owner token with a stale generation is fenced too.
	stale := b.Lease()
	stale.Generation = 1
	wantLeaseLost(t, "stale generation Complete", s.Complete(ctx(t), stale, response("A"), at(12)))
	got := mustGet(t, s, sc)
	if got.Owner != "b" || got.State != idempotency.InProgress || got.RecoveryPoint != "" {
		t.Fatalf("fenced writes changed the record: owner %q state %v rp %q", got.Owner, got.State,
			got.RecoveryPoint)
	}
	wantTime(t, "LeaseUntil (old heartbeat must not extend it)", got.LeaseUntil, at(21))
	noErr(t, "successor Complete", s.Complete(ctx(t), b.Lease(), response("B"), at(13)))
	wantLeaseLost(t, "old Complete after successor", s.Complete(ctx(t), old, response("A"), at(14)))
	got = mustGet(t, s, sc)
	if got.State != idempotency.Completed || got.Generation != 2 {
		t.Fatalf("final record: state %v gen %d", got.State, got.Generation)
	}
	wantResponse(t, got, response("B"))
}

func testRelease(t *testing.T, s idempotency.Store) {
	sc := scope("release")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	wantLeaseLost(t, "Release by a stranger", s.Release(ctx(t), idempotency.Lease{Scope: sc,
		Owner: "z", Generation: 1}))
	noErr(t, "Release", s.Release(ctx(t), a.Lease()))
	if _, err := s.Get(ctx(t), sc); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get after Release: err = %v, want ErrNotFound", err)
	}
	wantLeaseLost(t, "second Release", s.Release(ctx(t), a.Lease()))
	wantLeaseLost(t, "Complete after Release", s.Complete(ctx(t), a.Lease(), response("A"), at(1)))
	// The key is free again, for any fingerprint, before the old lease's end.
	b := mustClaim(t, s, claimOf(sc, "b", "other", at(1)), idempotency.ClaimCreated)
	if b.Owner != "b" || b.Fingerprint != "other" {
		t.Fatalf("claim after Release: owner %q fp %q", b.Owner, b.Fingerprint)
	}
	wantLeaseLost(t, "old lease after re-claim", s.Heartbeat(ctx(t), a.Lease(), at(50)))
	noErr(t, "new owner Complete", s.Complete(ctx(t), b.Lease(), response("B"), at(2)))
	wantResponse(t, mustGet(t, s, sc), response("B"))
}

func testHeartbeat(t *testing.T, s idempotency.Store) {
	sc := scope("heartbeat")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "Heartbeat", s.Heartbeat(ctx(t), a.Lease(), at(40)))
	wantTime(t, "LeaseUntil", mustGet(t, s, sc).LeaseUntil, at(40))
	mustClaim(t, s, claimOf(sc, "b", "fp", at(30)),
		idempotency.ClaimExisting) // the extended lease holds
	// A heartbeat to an earlier time moves the lease back.
	noErr(t, "Heartbeat to now", s.Heartbeat(ctx(t), a.Lease(), at(31)))
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(32)), idempotency.ClaimTakenOver)
	if b.Generation != 2 {
		t.Fatalf("takeover after a heartbeat to an earlier time: gen %d", b.Generation)
	}
}

// testHeartbeatEndsLease checks a Heartbeat to now, which ends a lease
// for a resume: the record stays in progress with its recovery point, the
// lease ends at now (inclusive), and only the owner can end it.
func testHeartbeatEndsLease(t *testing.T, s idempotency.Store) {
	sc := scope("end-lease")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "SetRecoveryPoint", s.SetRecoveryPoint(ctx(t), a.Lease(), "order", []byte("data"),
		at(1)))
	wantLeaseLost(t, "ending the lease of a stranger", s.Heartbeat(ctx(t),
		idempotency.Lease{Scope: sc, Owner: "z", Generation: 1}, at(2)))
	noErr(t, "Heartbeat to now", s.Heartbeat(ctx(t), a.Lease(), at(2)))
	got := mustGet(t, s, sc)
	if got.State != idempotency.InProgress || got.Owner != "a" || got.RecoveryPoint != "order" {
		t.Fatalf("after the lease ended: state %v owner %q point %q; want in_progress a order",
			got.State, got.Owner, got.RecoveryPoint)
	}
	wantTime(t, "LeaseUntil after the lease ended", got.LeaseUntil, at(2))
	mustClaim(t, s, claimOf(sc, "b", "fp", at(2)),
		idempotency.ClaimExisting) // alive until LeaseUntil inclusive
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(3)), idempotency.ClaimTakenOver)
	if b.RecoveryPoint != "order" || b.Generation != 2 {
		t.Fatalf("takeover after the lease ended: point %q gen %d; want order 2", b.RecoveryPoint,
			b.Generation)
	}
	wantLeaseLost(t, "ending the lease by the old owner", s.Heartbeat(ctx(t), a.Lease(), at(4)))
	noErr(t, "Complete", s.Complete(ctx(t), b.Lease(), response("b"), at(4)))
	wantLeaseLost(t, "ending the lease of a completed record", s.Heartbeat(ctx(t), b.Lease(),
		at(5)))
}

func testRecoveryPoint(t *testing.T, s idempotency.Store) {
	sc := scope("recovery")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "SetRecoveryPoint", s.SetRecoveryPoint(ctx(t), a.Lease(), "order-created",
		[]byte(`{"order":7}`), at(1)))
	got := mustGet(t, s, sc)
	if got.RecoveryPoint != "order-created" || string(got.RecoveryData) != `{"order":7}` {
		t.Fatalf("recovery point = %q %q", got.RecoveryPoint, got.RecoveryData)
	}
	wantTime(t, "UpdatedAt after SetRecoveryPoint", got.UpdatedAt, at(1))
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(20)), idempotency.ClaimTakenOver)
	if b.RecoveryPoint != "order-created" || string(b.RecoveryData) != `{"order":7}` {
		t.Fatalf("takeover lost the recovery point: %q %q", b.RecoveryPoint, b.RecoveryData)
	}
	noErr(t, "successor SetRecoveryPoint", s.SetRecoveryPoint(ctx(t), b.Lease(), "charged",
		[]byte("ch_1"), at(21)))
	noErr(t, "successor Complete", s.Complete(ctx(t), b.Lease(), response("done"), at(22)))
	got = mustGet(t, s, sc)
	if got.RecoveryPoint != "charged" || string(got.RecoveryData) != "ch_1" ||
		got.State != idempotency.Completed {
		t.Fatalf("final: rp %q data %q state %v", got.RecoveryPoint, got.RecoveryData, got.State)
	}
}

func testAbandoned(t *testing.T, st idempotency.Store) {
	s := st.(store)
	// Three abandoned records with staggered leases, one live, one completed.
	for i, key := range []string{"ab-1", "ab-2", "ab-3"} {
		mustClaim(t, s, claimOf(scope(key), "o", "fp", at(i)), idempotency.ClaimCreated)
	}
	mustClaim(t, s, claimOf(scope("live"), "o", "fp", at(50)), idempotency.ClaimCreated)
	done := mustClaim(t, s, claimOf(scope("done"), "o", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), done.Lease(), response("d"), at(1)))

	now := at(30)
	all, err := s.Abandoned(ctx(t), now, 10)
	noErr(t, "Abandoned", err)
	var keys []string
	for _, r := range all {
		keys = append(keys, r.Scope.Key)
		if r.State != idempotency.InProgress || r.Owner != "o" {
			t.Fatalf("Abandoned returned %q in state %v", r.Scope.Key, r.State)
		}
	}
	if fmt.Sprint(keys) != "[ab-1 ab-2 ab-3]" {
		t.Fatalf("Abandoned keys = %v, want [ab-1 ab-2 ab-3] (oldest first)", keys)
	}
	two, err := s.Abandoned(ctx(t), now, 2)
	noErr(t, "Abandoned limit 2", err)
	if len(two) != 2 || two[0].Scope.Key != "ab-1" || two[1].Scope.Key != "ab-2" {
		t.Fatalf("Abandoned limit 2 = %d records", len(two))
	}
	early, err := s.Abandoned(ctx(t), at(5), 10)
	noErr(t, "Abandoned early", err)
	if len(early) != 0 {
		t.Fatalf("Abandoned before any lease expired = %d records", len(early))
	}
}

func testDeleteBefore(t *testing.T, st idempotency.Store) {
	s := st.(store)
	// Completed long ago (x3), completed recently, in progress with an old
	// expired lease, in progress but still leased past the horizon.
	for i, key := range []string{"old-1", "old-2", "old-3"} {
		r := mustClaim(t, s, claimOf(scope(key), "o", "fp", at(i)), idempotency.ClaimCreated)
		noErr(t, "Complete", s.Complete(ctx(t), r.Lease(), response(key), at(i+1)))
	}
	r := mustClaim(t, s, claimOf(scope("recent"), "o", "fp", at(500)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), r.Lease(), response("recent"), at(501)))
	mustClaim(t, s, claimOf(scope("stuck"), "o", "fp", at(5)),
		idempotency.ClaimCreated) // lease until at(15)
	leased := mustClaim(t, s, claimOf(scope("leased"), "o", "fp", at(5)), idempotency.ClaimCreated)
	noErr(t, "Heartbeat", s.Heartbeat(ctx(t), leased.Lease(), at(1000)))

	horizon := at(100)
	n, err := s.DeleteBefore(ctx(t), horizon, 2)
	noErr(t, "DeleteBefore batch 1", err)
	if n != 2 {
		t.Fatalf("DeleteBefore limit 2 deleted %d", n)
	}
	total := n
	for range 5 {
		n, err = s.DeleteBefore(ctx(t), horizon, 2)
		noErr(t, "DeleteBefore", err)
		if n > 2 {
			t.Fatalf("DeleteBefore limit 2 deleted %d", n)
		}
		if n == 0 {
			break
		}
		total += n
	}
	if total != 4 {
		t.Fatalf("DeleteBefore deleted %d records in all, want 4 (old-1..3, stuck)", total)
	}
	for _, key := range []string{"old-1", "old-2", "old-3", "stuck"} {
		if _, err := s.Get(ctx(t), scope(key)); !errors.Is(err, idempotency.ErrNotFound) {
			t.Fatalf("%s survived DeleteBefore: err = %v", key, err)
		}
	}
	for _, key := range []string{"recent", "leased"} {
		mustGet(t, s, scope(key))
	}
}

func testRequestBytes(t *testing.T, s idempotency.Store) {
	c := claimOf(scope("request"), "a", "fp", at(0))
	c.Request = []byte("POST /payments\x00\xff binary \"ok\"")
	mustClaim(t, s, c, idempotency.ClaimCreated)
	if got := mustGet(t, s, c.Scope); !bytes.Equal(got.Request, c.Request) {
		t.Fatalf("Get returned Request %q, want %q", got.Request, c.Request)
	}
	b := mustClaim(t, s, claimOf(c.Scope, "b", "fp", at(20)), idempotency.ClaimTakenOver)
	if !bytes.Equal(b.Request, c.Request) {
		t.Fatalf("takeover returned Request %q, want %q", b.Request, c.Request)
	}
	c2 := claimOf(scope("request-nil"), "a", "fp", at(0))
	c2.Request = nil
	mustClaim(t, s, c2, idempotency.ClaimCreated)
	if got := mustGet(t, s, c2.Scope); len(got.Request) != 0 {
		t.Fatalf("nil Request stored as %q", got.Request)
	}
}

// testCompleterClaim checks the claim the Completer makes: ReplayWindow 0
// and no Request. It never restarts a completed record, however old, and a
// takeover keeps the stored request and recovery point.
func testCompleterClaim(t *testing.T, s idempotency.Store) {
	done := mustClaim(t, s, claimOf(scope("completer-done"), "a", "fp", at(0)),
		idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), done.Lease(), response("old"), at(1)))
	c := claimOf(done.Scope, "completer", "fp", at(1).Add(100*window))
	c.ReplayWindow, c.Request = 0, nil
	if got := mustClaim(t, s, c, idempotency.ClaimExisting); got.State != idempotency.Completed ||
		got.Owner != "a" {
		t.Fatalf("a claim with ReplayWindow 0 changed a completed record: state %v owner %q",
			got.State, got.Owner)
	}

	orig := claimOf(scope("completer-takeover"), "a", "fp", at(0))
	rec := mustClaim(t, s, orig, idempotency.ClaimCreated)
	noErr(t, "SetRecoveryPoint", s.SetRecoveryPoint(ctx(t), rec.Lease(), "order", []byte("data"),
		at(1)))
	c = claimOf(orig.Scope, "completer", "fp", at(11))
	c.ReplayWindow, c.Request = 0, nil
	got := mustClaim(t, s, c, idempotency.ClaimTakenOver)
	if got.Generation != rec.Generation+1 || got.RecoveryPoint != "order" ||
		!bytes.Equal(got.RecoveryData, []byte("data")) ||
		!bytes.Equal(got.Request, orig.Request) {
		t.Fatalf("completer takeover: gen %d point %q data %q request %q; want %d order data %q",
			got.Generation, got.RecoveryPoint, got.RecoveryData, got.Request, rec.Generation+1,
			orig.Request)
	}
	wantTime(t, "CreatedAt after takeover", got.CreatedAt, at(0))
}

func begin(t *testing.T, s idempotency.Store, l idempotency.Lease) (idempotency.Unit, error) {
	t.Helper()
	u, uctx, err := s.(idempotency.Transactor).Begin(ctx(t), l)
	if err == nil && uctx == nil {
		t.Fatal("Begin returned a nil context")
	}
	if err == nil {
		t.Cleanup(func() { _ = u.Rollback() })
	}
	return u, err
}

func testUnitCommit(t *testing.T, s idempotency.Store) {
	sc := scope("unit-commit")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	u, err := begin(t, s, a.Lease())
	noErr(t, "Begin", err)
	noErr(t, "Unit.SetRecoveryPoint", u.SetRecoveryPoint(ctx(t), "phase-1", []byte("d1"), at(1)))
	noErr(t, "Unit.Complete", u.Complete(ctx(t), response("u"), at(2)))
	// Get from outside the unit (it may block until the commit in a store
	// with row locks, so it runs concurrently and is checked after).
	type getResult struct {
		rec idempotency.Record
		err error
	}
	before := make(chan getResult, 1)
	go func() {
		r, err := s.Get(context.Background(), sc)
		before <- getResult{r, err}
	}()
	var seen *getResult
	select {
	case g := <-before:
		seen = &g
	case <-time.After(100 * time.Millisecond):
		// blocked by the unit: fine, checked below
	}
	noErr(t, "Unit.Commit", u.Commit())
	if seen == nil {
		g := <-before
		seen = &g
	}
	noErr(t, "Get during the unit", seen.err)
	if seen.rec.State == idempotency.Completed && seen.rec.RecoveryPoint == "" {
		t.Fatalf("a reader saw a partial unit: completed without its recovery point")
	}
	if seen.rec.State != idempotency.InProgress && seen.rec.State != idempotency.Completed {
		t.Fatalf("reader saw state %v", seen.rec.State)
	}
	got := mustGet(t, s, sc)
	if got.State != idempotency.Completed || got.RecoveryPoint != "phase-1" ||
		string(got.RecoveryData) != "d1" {
		t.Fatalf("after Commit: state %v rp %q data %q", got.State, got.RecoveryPoint,
			got.RecoveryData)
	}
	if got.Owner != "a" || got.Generation != a.Generation {
		t.Fatalf("a record completed in a unit keeps its owner and generation: owner %q gen %d",
			got.Owner, got.Generation)
	}
	wantResponse(t, got, response("u"))
	_ = u.Rollback() // safe after Commit; must not undo it
	if got := mustGet(t, s, sc); got.State != idempotency.Completed {
		t.Fatalf("Rollback after Commit undid it: state %v", got.State)
	}
}

func testUnitRollback(t *testing.T, s idempotency.Store) {
	sc := scope("unit-rollback")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	u, err := begin(t, s, a.Lease())
	noErr(t, "Begin", err)
	noErr(t, "Unit.SetRecoveryPoint", u.SetRecoveryPoint(ctx(t), "phase-1", []byte("d1"), at(1)))
	noErr(t, "Unit.Complete", u.Complete(ctx(t), response("u"), at(2)))
	noErr(t, "Unit.Rollback", u.Rollback())
	got := mustGet(t, s, sc)
	if got.State != idempotency.InProgress || got.RecoveryPoint != "" || got.Response != nil ||
		got.Owner != "a" {
		t.Fatalf("after Rollback: state %v rp %q response %v owner %q", got.State,
			got.RecoveryPoint, got.Response, got.Owner)
	}
	// The lease still holds: the owner can complete outside the unit.
	noErr(t, "Complete after Rollback", s.Complete(ctx(t), a.Lease(), response("direct"), at(3)))
	wantResponse(t, mustGet(t, s, sc), response("direct"))
}

func testUnitLeaseLost(t *testing.T, s idempotency.Store) {
	sc := scope("unit-lost")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(11)),
		idempotency.ClaimTakenOver) // a's lease moved
	// The stale unit must fail at Begin, at a write or at Commit.
	u, err := begin(t, s, a.Lease())
	if err == nil {
		err = u.SetRecoveryPoint(ctx(t), "late", []byte("x"), at(12))
	}
	if err == nil {
		err = u.Complete(ctx(t), response("A"), at(12))
	}
	if err == nil {
		err = u.Commit()
	}
	wantLeaseLost(t, "stale unit", err)
	got := mustGet(t, s, sc)
	if got.Owner != "b" || got.Generation != b.Generation || got.State != idempotency.InProgress ||
		got.RecoveryPoint != "" {
		t.Fatalf("stale unit changed the record: owner %q gen %d state %v rp %q", got.Owner,
			got.Generation, got.State, got.RecoveryPoint)
	}
	noErr(t, "successor Complete", s.Complete(ctx(t), b.Lease(), response("B"), at(13)))
	wantResponse(t, mustGet(t, s, sc), response("B"))
}

// testUnitRace runs a takeover concurrently with an open unit of the expired
// owner. Either serialisation is allowed, but never both: if the unit
// commits, the takeover must not acquire; if the takeover acquires, the
// unit must fail with ErrLeaseLost and the successor owns the record.
func testUnitRace(t *testing.T, s idempotency.Store) {
	sc := scope("unit-race")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
	u, err := begin(t, s, a.Lease())
	noErr(t, "Begin", err)
	type claimResult struct {
		acquired bool
		err      error
	}
	done := make(chan claimResult, 1)
	go func() {
		res, err := s.Claim(context.Background(), claimOf(sc, "b", "fp", at(11)))
		done <- claimResult{res.Outcome == idempotency.ClaimTakenOver, err}
	}()
	err = u.Complete(ctx(t), response("A"), at(11))
	if err == nil {
		err = u.Commit()
	}
	if err != nil {
		_ = u.Rollback()
	}
	cr := <-done
	noErr(t, "concurrent Claim", cr.err)
	got := mustGet(t, s, sc)
	switch {
	case err == nil && cr.acquired:
		t.Fatal("both the stale unit committed and the takeover acquired the record")
	case err == nil:
		if got.State != idempotency.Completed || got.Owner != "a" {
			t.Fatalf("unit committed but record is state %v owner %q", got.State, got.Owner)
		}
		wantResponse(t, got, response("A"))
	case cr.acquired:
		wantLeaseLost(t, "unit after takeover", err)
		if got.State != idempotency.InProgress || got.Owner != "b" || got.Generation != 2 {
			t.Fatalf("after takeover: state %v owner %q gen %d", got.State, got.Owner,
				got.Generation)
		}
	default:
		t.Fatalf("neither the unit (%v) nor the takeover succeeded", err)
	}
}

// testBoundaries pins the edges every store must agree on (the SQL stores
// compare with <): a lease is expired only when LeaseUntil < now, strictly,
// for a takeover and for Abandoned; a completed record is out of the replay
// window only when CompletedAt < now - ReplayWindow, strictly; DeleteBefore
// removes only records last updated (and, in progress, leased) strictly
// before the horizon.
func testBoundaries(t *testing.T, s idempotency.Store) {
	sc := scope("boundary-lease")
	a := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)),
		idempotency.ClaimCreated) // lease until at(10)
	wantTime(t, "LeaseUntil", a.LeaseUntil, at(10))
	if got := mustClaim(t, s, claimOf(sc, "b", "fp", at(10)),
		idempotency.ClaimExisting); got.Owner != "a" || got.Generation != 1 {
		t.Fatalf("claim at LeaseUntil took the record over: owner %q gen %d; a lease is alive "+
			"until LeaseUntil inclusive",
			got.Owner, got.Generation)
	}
	sweeper, sweeps := s.(idempotency.Sweeper)
	if sweeps {
		recs, err := sweeper.Abandoned(ctx(t), at(10), 10)
		noErr(t, "Abandoned at LeaseUntil", err)
		if len(recs) != 0 {
			t.Fatalf("Abandoned(now = LeaseUntil) listed %d records, want 0 (expired means "+
				"LeaseUntil < now)", len(recs))
		}
		recs, err = sweeper.Abandoned(ctx(t), at(11), 10)
		noErr(t, "Abandoned after LeaseUntil", err)
		if len(recs) != 1 || recs[0].Scope != sc {
			t.Fatalf("Abandoned(now > LeaseUntil) listed %d records, want the one", len(recs))
		}
		if n, err := sweeper.DeleteBefore(ctx(t), at(10), 10); err != nil || n != 0 {
			t.Fatalf("DeleteBefore(horizon = LeaseUntil) = %d, %v; want 0 (an in-progress "+
				"record goes only when LeaseUntil < horizon)", n, err)
		}
	}
	b := mustClaim(t, s, claimOf(sc, "b", "fp", at(11)), idempotency.ClaimTakenOver)
	if b.Generation != 2 {
		t.Fatalf("takeover after LeaseUntil: gen %d, want 2", b.Generation)
	}

	sw := scope("boundary-window")
	c := mustClaim(t, s, claimOf(sw, "a", "fp", at(0)), idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), c.Lease(), response("w"), at(1)))
	edge := at(1).Add(window) // CompletedAt == now - ReplayWindow: still inside
	if got := mustClaim(t, s, claimOf(sw, "b", "fp", edge),
		idempotency.ClaimExisting); got.State != idempotency.Completed || got.Owner != "a" {
		t.Fatalf("claim at CompletedAt + ReplayWindow restarted the record: state %v owner %q",
			got.State, got.Owner)
	}
	if sweeps {
		if n, err := sweeper.DeleteBefore(ctx(t), at(1), 10); err != nil || n != 0 {
			t.Fatalf("DeleteBefore(horizon = UpdatedAt) = %d, %v; want 0 (a record goes only "+
				"when updated strictly before the horizon)", n, err)
		}
	}
	if got := mustClaim(t, s, claimOf(sw, "b", "fp", edge.Add(time.Second)),
		idempotency.ClaimCreated); got.Generation != 2 {
		t.Fatalf("claim after the window: gen %d, want 2", got.Generation)
	}
}

// testTakeoverOnly checks Claim.TakeoverOnly: no record is created for an
// absent scope, a completed record is never restarted (whatever the
// ReplayWindow), an expired lease is taken over as usual.
func testTakeoverOnly(t *testing.T, s idempotency.Store) {
	absent := claimOf(scope("takeover-only-absent"), "completer", "fp", at(0))
	absent.Request, absent.TakeoverOnly = nil, true
	res, err := s.Claim(ctx(t), absent)
	noErr(t, "TakeoverOnly claim of an absent scope", err)
	rec := res.Record
	if res.Outcome != idempotency.ClaimExisting {
		t.Fatalf("a TakeoverOnly claim of an absent scope: outcome %v (owner %q gen %d); want "+
			"existing with a zero record",
			res.Outcome, rec.Owner, rec.Generation)
	}
	if rec.State != idempotency.Absent || rec.Owner != "" {
		t.Fatalf("TakeoverOnly claim of an absent scope returned state %v owner %q, want a zero "+
			"record", rec.State, rec.Owner)
	}
	if _, err := s.Get(ctx(t), absent.Scope); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("TakeoverOnly claim of an absent scope left a record: Get err = %v", err)
	}

	done := mustClaim(t, s, claimOf(scope("takeover-only-done"), "a", "fp", at(0)),
		idempotency.ClaimCreated)
	noErr(t, "Complete", s.Complete(ctx(t), done.Lease(), response("d"), at(1)))
	c := claimOf(done.Scope, "completer", "fp", at(1).Add(10*window))
	c.Request, c.TakeoverOnly = nil, true // ReplayWindow stays set: TakeoverOnly wins
	if got := mustClaim(t, s, c, idempotency.ClaimExisting); got.State != idempotency.Completed ||
		got.Owner != "a" || got.Generation != 1 {
		t.Fatalf("TakeoverOnly claim restarted a completed record: state %v owner %q gen %d",
			got.State, got.Owner, got.Generation)
	}
	wantResponse(t, mustGet(t, s, done.Scope), response("d"))

	orig := claimOf(scope("takeover-only-expired"), "a", "fp", at(0))
	mustClaim(t, s, orig, idempotency.ClaimCreated)
	c = claimOf(orig.Scope, "completer", "fp", at(5))
	c.Request, c.TakeoverOnly = nil, true
	mustClaim(t, s, c, idempotency.ClaimExisting) // the lease is alive
	c.Now = at(11)
	got := mustClaim(t, s, c, idempotency.ClaimTakenOver)
	if got.Owner != "completer" || got.Generation != 2 || !bytes.Equal(got.Request, orig.Request) {
		t.Fatalf("TakeoverOnly takeover: owner %q gen %d request %q; want completer 2 %q",
			got.Owner, got.Generation, got.Request, orig.Request)
	}
}

// maxDuration is the longest time.Duration: the middleware passes it as
// LeaseFor or ReplayWindow for "forever".
const maxDuration = time.Duration(1<<63 - 1)

// A lease and a replay window of the longest Duration (and the horizon
// the middleware then uses, now - that Duration) mean forever: the lease
// never expires, the record is never restarted, listed or deleted, and
// nothing overflows into the past.
func testDurationLimits(t *testing.T, s idempotency.Store) {
	sc := scope("limits")
	c := claimOf(sc, "a", "fp", at(0))
	c.LeaseFor, c.ReplayWindow = maxDuration, maxDuration
	res, err := s.Claim(ctx(t),
		c) // a store may keep the lease's end to its own limit (year 2262, say)
	noErr(t, "Claim", err)
	a := res.Record
	if res.Outcome != idempotency.ClaimCreated ||
		!a.LeaseUntil.After(at(0).Add(200*365*24*time.Hour)) {
		t.Fatalf("a claim with a lease of the longest Duration: outcome %v, lease until %v",
			res.Outcome, a.LeaseUntil)
	}
	later := at(0).Add(200 * 365 * 24 * time.Hour) // before 2262
	c2 := claimOf(sc, "b", "fp", later)
	c2.LeaseFor, c2.ReplayWindow = maxDuration, maxDuration
	if got := mustClaim(t, s, c2, idempotency.ClaimExisting); got.Owner != "a" {
		t.Fatalf("a lease of the longest Duration was taken over 200 years later: owner %q",
			got.Owner)
	}
	sweeper, sweeps := s.(idempotency.Sweeper)
	if sweeps {
		recs, err := sweeper.Abandoned(ctx(t), later, 10)
		noErr(t, "Abandoned", err)
		if len(recs) != 0 {
			t.Fatalf("Abandoned listed a record whose lease is the longest Duration")
		}
	}
	noErr(t, "Complete", s.Complete(ctx(t), a.Lease(), response("forever"), at(1)))
	if got := mustClaim(t, s, c2, idempotency.ClaimExisting); got.State != idempotency.Completed ||
		got.Owner != "a" {
		t.Fatalf("a record completed under the longest replay window was restarted 200 years "+
			"later: state %v owner %q",
			got.State, got.Owner)
	}
	if sweeps {
		if n, err := sweeper.DeleteBefore(ctx(t), later.Add(-maxDuration), 10); err != nil ||
			n != 0 {
			t.Fatalf("DeleteBefore(now - the longest Duration) = %d, %v; want 0", n, err)
		}
	}
	wantResponse(t, mustGet(t, s, sc), response("forever"))
}
