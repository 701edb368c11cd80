// Package idempotencytest is the conformance suite for implementations of
// idempotency.Store, in the style of testing/fstest: a store's own tests call
// TestStore with a constructor, and the suite checks the contract the
// middleware relies on (atomic claims, the replay window, lease takeover,
// fencing, release, heartbeats that end a lease, recovery points and, for a
// Sweeper, the completer's and reaper's listings, for a Transactor, unit
// atomicity), then runs both doors of the middleware over the store
// through the recovery paths that rest on what it keeps: the Middleware
// subtests (the HTTP door) and the Do subtests (the function door: replays
// byte for byte, conflicts, failures, a fenced takeover, the Completer, a
// claim whose answer was lost). TestBoundedStore checks, for a store that
// holds a bounded number of records, that it fails closed when full.
//
// Every store runs every Store, Middleware and Do subtest of TestStore that
// applies to it. The Unit subtests (UnitCommitVisibility, UnitRollback,
// UnitLeaseLostAtCommit, UnitRaceWithTakeover) and the unit half of
// MiddlewareCompletionAnswerLost run for a store that implements
// idempotency.Transactor (memstore, sqlstore) and are not registered for
// one that does not (redisstore); the ClaimInUnit subtests
// (ClaimInUnitCommit, ClaimInUnitRollback, ClaimInUnitLeavesWinsToClaim)
// for a store that implements idempotency.ClaimTransactor (sqlstore); the
// subtests of the listings and of the
// background jobs (Abandoned, DeleteBefore, MiddlewareResumeWithoutCredentials,
// MiddlewareDurationsAtTheirLimits, DoCompleterResumes), and the listing
// checks of other subtests, for a store that implements
// idempotency.Sweeper (every store of this module). A check that does not
// apply to a store is absent from its run, never a skipped test.
package idempotencytest
