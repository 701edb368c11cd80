// Package idempotencytest is the conformance suite for implementations of
// idempotency.Store, in the style of testing/fstest: a store's own tests call
// TestStore with a constructor, and the suite checks the contract the
// middleware relies on (atomic claims, the replay window, lease takeover,
// fencing, release, recovery points, the completer and reaper queries and,
// for a Transactor, unit atomicity), then runs the middleware over the
// store through the recovery paths that rest on what it keeps (the
// Middleware subtests). TestBoundedStore checks, for a store that holds a
// bounded number of records, that it fails closed when full.
//
// Every store runs every Store and Middleware subtest of TestStore. The
// Unit subtests (UnitCommitVisibility, UnitRollback, UnitLeaseLostAtCommit,
// UnitRaceWithTakeover) and the unit half of MiddlewareCompletionAnswerLost
// run for a store that implements idempotency.Transactor (memstore,
// sqlstore) and are not registered for one that does not (redisstore): a
// check that does not apply to a store is absent from its run, never a
// skipped test.
package idempotencytest
