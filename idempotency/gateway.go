package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// storeTimeout bounds each try of a store call the library makes on its own
// behalf, the wait for a unit of work to begin, the tries again of a call
// that failed without an answer, and the reads that settle a write whose
// outcome is unknown.
const storeTimeout = 10 * time.Second

// The pauses between the tries of a call: 20 ms, doubled after each try,
// at most a second.
const (
	firstRetryPause = 20 * time.Millisecond
	maxRetryPause   = time.Second
)

// gateway is the one way to the store: every call the middleware, its
// doors, its Completer and its Reaper make goes through try, which bounds
// it in time, reports it to the observers and, as retries says, tries it
// again on a fresh connection after a failure that is not one of the
// store's answers.
type gateway struct {
	store   Store
	tx      Transactor      // the store, when it is one
	claimTx ClaimTransactor // the store, when it is one
	sweeper Sweeper         // the store, when it is one
	obs     observers
}

func newGateway(store Store, obs observers) gateway {
	g := gateway{store: store, obs: obs}
	g.tx, _ = store.(Transactor)
	g.claimTx, _ = store.(ClaimTransactor)
	g.sweeper, _ = store.(Sweeper)
	return g
}

// kind is one kind of store call: the Op it is reported as, and whether,
// after a failure that is not one of the store's answers, it is tried again
// (on a fresh connection, within storeTimeout) or not.
type kind struct {
	op    Op
	retry bool
}

// The kinds of store calls: the one place that sets each call's retry
// policy. A read and a fenced write outside a unit are tried again: a
// repeat of a write that applied changes nothing, or fails with
// ErrLeaseLost when the write ended the record's progress (then the record
// is read back). So is a heartbeat, a fenced write too, within the bound
// its beat gives it (the context's deadline: see heartbeat.beat). A claim
// is not: the record is read back once instead (claim), so that an outage
// does not multiply the claims of every request. A unit's write and Commit
// cannot be repeated (the record is read back). Begin, Rollback and the
// background jobs' listings and deletes are their callers' to repeat.
var (
	kindClaim          = kind{OpClaim, false}
	kindClaimReadBack  = kind{OpGet, false}
	kindGet            = kind{OpGet, true}
	kindHeartbeat      = kind{OpHeartbeat, true}
	kindEndLease       = kind{OpEndLease, true}
	kindRelease        = kind{OpRelease, true}
	kindComplete       = kind{OpComplete, true}
	kindCompleteInUnit = kind{OpComplete, false}
	kindSetPoint       = kind{OpSetRecoveryPoint, true}
	kindSetPointInUnit = kind{OpSetRecoveryPoint, false}
	kindAbandoned      = kind{OpAbandoned, false}
	kindDeleteBefore   = kind{OpDeleteBefore, false}
)

// isAnswer reports whether err is one of the store's answers, not a failure
// of the call: trying again would get it again.
func isAnswer(err error) bool {
	return errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotFound) ||
		errors.Is(err, ErrStoreFull) || errors.Is(err, ErrRecordTooLarge)
}

// try makes f, a store call of kind k on s (the zero Scope for a call
// about no single record), on ctx with at most storeTimeout left, and
// reports it to the observers as k.op. When k says so, it tries f again
// after a failure that is not one of the store's answers, pausing between
// tries (20 ms, doubled, at most 1 s), for at most storeTimeout after the
// first. It returns the last error and whether a try failed with an error
// that leaves the call's outcome unknown (not an answer).
func (g gateway) try(ctx context.Context, k kind, s Scope,
	f func(ctx context.Context) error) (err error, unknown bool) {
	once := func(ctx context.Context) error {
		cctx, cancel := context.WithTimeout(ctx, storeTimeout)
		defer cancel()
		start := time.Now()
		err := f(cctx)
		g.obs.storeCall(ctx, k.op, s, start, err)
		return err
	}
	deadline := time.Now().Add(storeTimeout)
	if err = once(ctx); err == nil || isAnswer(err) {
		return err, false
	}
	if !k.retry {
		return err, true
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	for pause := firstRetryPause; ; pause = min(2*pause, maxRetryPause) {
		if wait.Sleep(ctx, pause) != nil {
			return err, true
		}
		if err = once(ctx); err == nil || isAnswer(err) {
			return err, true
		}
	}
}

// call is try for a call whose unknown outcome its caller does not settle.
func (g gateway) call(ctx context.Context, k kind, s Scope,
	f func(ctx context.Context) error) error {
	err, _ := g.try(ctx, k, s, f)
	return err
}

// get reads s's record, as a call of kind k (OpGet).
func (g gateway) get(ctx context.Context, k kind, s Scope) (Record, error) {
	var rec Record
	err := g.call(ctx, k, s, func(ctx context.Context) (err error) {
		rec, err = g.store.Get(ctx, s)
		return err
	})
	return rec, err
}

// claim claims c.Scope (OpClaim). When the claim fails without an answer,
// whether it applied is the store's to say (the connection died after the
// INSERT committed, a proxy dropped the reply): the record is read back
// once, and a record in progress with c's owner token (minted for this
// claim alone) is the claim's, taken as the store would have answered it;
// else the claim's error stands. So is a record the claim answers as
// existing but holds c's owner token: a store that ran the claim again
// after losing its first answer. So a claim never leaves a lease that
// nobody holds, unless the store cannot even be read (then the lease runs
// out).
func (g gateway) claim(ctx context.Context, c Claim) (ClaimResult, error) {
	var res ClaimResult
	err, unknown := g.try(ctx, kindClaim, c.Scope, func(ctx context.Context) (err error) {
		res, err = g.store.Claim(ctx, c)
		return err
	})
	switch {
	case err == nil && (res.Acquired() || !claimedBy(res.Record, c)):
		return res, nil
	case err != nil && !unknown:
		return res, err
	}
	rec, rerr := g.get(ctx, kindClaimReadBack, c.Scope)
	switch {
	case rerr == nil && claimedBy(rec, c):
	case err != nil:
		return ClaimResult{}, err // the claim did not apply, or nothing can tell
	case errors.Is(rerr, ErrNotFound):
		return ClaimResult{}, nil // gone meanwhile: as a claim that found nothing
	case rerr != nil:
		return ClaimResult{}, rerr
	default:
		return ClaimResult{Record: rec}, nil // no longer the claim's
	}
	outcome := ClaimTakenOver // a takeover keeps the request stored by the first claim
	if bytes.Equal(rec.Request, c.Request) {
		outcome = ClaimCreated
	}
	return ClaimResult{Outcome: outcome, Record: rec}, nil
}

// errClaimTimeout ends the wait of claimInUnit.
var errClaimTimeout = fmt.Errorf(
	"idempotency: the store did not claim in a unit of work within its bound: %w",
	context.DeadlineExceeded)

// errCallerGone is claimInUnit's error when its caller went away first.
var errCallerGone = errors.New("idempotency: the caller went away while its claim waited")

// claimInUnit claims c.Scope in a unit of the store's (OpClaim), as
// ClaimInUnit says, on ctx, waiting for it at most storeTimeout after wait
// and while caller lives: when caller ends first, the claim ends with
// errCallerGone and caller's cause. A claim that created the record holds
// it in res.unit, which lives until it is written or ended, like begin's;
// one that did not is the store's answer, or a zero Record when c is to be
// claimed with claim. Nothing is read back: a unit that failed committed
// nothing.
func (g gateway) claimInUnit(ctx, caller context.Context, c Claim, wait time.Duration) (
	ClaimResult, error) {
	start := time.Now()
	bctx, abort := context.WithCancelCause(ctx)
	timer := time.AfterFunc(addSat(storeTimeout, wait), func() { abort(errClaimTimeout) })
	unhook := context.AfterFunc(caller, func() { abort(context.Cause(caller)) })
	res, u, uctx, err := g.claimTx.ClaimInUnit(bctx, c, wait)
	late, gone := !timer.Stop(), !unhook()
	switch {
	case gone: // bctx is canceled, and the unit with it: nothing is claimed
		err = fmt.Errorf("%w: %w", errCallerGone, context.Cause(caller))
	case late && err == nil:
		err = errClaimTimeout
	}
	g.obs.storeCall(ctx, OpClaim, c.Scope, start, err)
	if err == nil && u != nil {
		res.unit = &openUnit{Unit: u, lease: res.Record.Lease(), ctx: uctx, abort: abort,
			inTx: true, claimed: true}
		return res, nil
	}
	if u != nil { // begun, then failed or too late: nothing of it may stand
		g.end(ctx, &openUnit{Unit: u, lease: res.Record.Lease(), inTx: true})
	}
	abort(nil)
	if err != nil {
		return ClaimResult{}, err
	}
	return res, nil
}

// claimedBy reports whether rec is in progress under c's owner token.
func claimedBy(rec Record, c Claim) bool {
	return rec.State == InProgress && rec.Owner == c.Owner
}

// heartbeat sets l's lease end to until (OpHeartbeat).
func (g gateway) heartbeat(ctx context.Context, l Lease, until time.Time) error {
	return g.call(ctx, kindHeartbeat, l.Scope, func(ctx context.Context) error {
		return g.store.Heartbeat(ctx, l, until)
	})
}

// endLease ends l's lease at now, keeping the record in progress for a
// resume (OpEndLease: a heartbeat to now).
func (g gateway) endLease(ctx context.Context, l Lease) error {
	return g.call(ctx, kindEndLease, l.Scope, func(ctx context.Context) error {
		return g.store.Heartbeat(ctx, l, time.Now())
	})
}

// release deletes l's record (OpRelease). A release whose outcome is
// unknown and that was answered ErrLeaseLost when tried again is read
// back: no record means the first try applied.
func (g gateway) release(ctx context.Context, l Lease) error {
	err, unknown := g.try(ctx, kindRelease, l.Scope, func(ctx context.Context) error {
		return g.store.Release(ctx, l)
	})
	if unknown && errors.Is(err, ErrLeaseLost) && g.readBack(ctx, l.Scope,
		func(_ Record, err error) bool { return errors.Is(err, ErrNotFound) }) {
		return nil
	}
	return err
}

// abandoned lists the abandoned records (OpAbandoned).
func (g gateway) abandoned(ctx context.Context, now time.Time, limit int) ([]Record, error) {
	var recs []Record
	err := g.call(ctx, kindAbandoned, Scope{}, func(ctx context.Context) (err error) {
		recs, err = g.sweeper.Abandoned(ctx, now, limit)
		return err
	})
	return recs, err
}

// deleteBefore deletes records past horizon (OpDeleteBefore).
func (g gateway) deleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	var n int
	err := g.call(ctx, kindDeleteBefore, Scope{}, func(ctx context.Context) (err error) {
		n, err = g.sweeper.DeleteBefore(ctx, horizon, limit)
		return err
	})
	return n, err
}

// readBack reads s's record, trying again within storeTimeout while the
// store fails, and returns what applied says of it (false when it cannot
// be read): whether a write whose outcome was unknown applied.
func (g gateway) readBack(ctx context.Context, s Scope,
	applied func(rec Record, err error) bool) bool {
	rec, err := g.get(ctx, kindGet, s)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return false
	}
	return applied(rec, err)
}

// ownedBy reports whether rec is held by l: its owner and generation.
func ownedBy(rec Record, l Lease) bool {
	return rec.Owner == l.Owner && rec.Generation == l.Generation
}

// openUnit is a unit of work of one lease, through which every write of
// the record's (a recovery point, a completion) goes: a unit of the store
// (a Transactor's, begun by begin), whose writes commit together with the
// handler's own; or, for a write outside any transaction, an auto-commit
// unit (autoCommit), whose every write applies at once, tried again like
// any fenced write. A unit is ended once, by write or by end, never twice.
type openUnit struct {
	Unit
	lease Lease
	ctx   context.Context         // Begin's, carrying the transaction; nil for auto-commit
	abort context.CancelCauseFunc // cancels the context Begin was given; nil for auto-commit
	inTx  bool                    // a unit of the store's: its writes can be rolled back
	// claimed: the unit holds the claim of its record (ClaimInUnit), which
	// its Rollback undoes.
	claimed bool
	ended   bool // committed (or its Commit failed) or rolled back
}

// autoCommit returns the auto-commit unit of l: its writes are the store's
// own fenced writes, and Commit and Rollback do nothing.
func (g gateway) autoCommit(l Lease) *openUnit {
	return &openUnit{Unit: autoUnit{store: g.store, lease: l}, lease: l}
}

// autoUnit is the Unit of a write outside any transaction.
type autoUnit struct {
	store Store
	lease Lease
}

func (u autoUnit) SetRecoveryPoint(ctx context.Context, point string, data []byte,
	now time.Time) error {
	return u.store.SetRecoveryPoint(ctx, u.lease, point, data, now)
}

func (u autoUnit) Complete(ctx context.Context, resp Response, now time.Time) error {
	return u.store.Complete(ctx, u.lease, resp, now)
}

func (autoUnit) Commit() error   { return nil }
func (autoUnit) Rollback() error { return nil }

// open returns the unit of l's next write and of the work done for it:
// one of the store's, begun, when the store is a Transactor, else an
// auto-commit unit.
func (g gateway) open(ctx context.Context, l Lease) (*openUnit, error) {
	if g.tx == nil {
		return g.autoCommit(l), nil
	}
	return g.begin(ctx, l)
}

// errBeginTimeout ends the wait of begin.
var errBeginTimeout = fmt.Errorf(
	"idempotency: the store did not begin a unit of work within %v: %w",
	storeTimeout, context.DeadlineExceeded)

// errCommitTimeout cancels the context of a unit whose Commit did not
// return within the bound of its call.
var errCommitTimeout = fmt.Errorf(
	"idempotency: the store did not commit a unit of work within %v: %w",
	storeTimeout, context.DeadlineExceeded)

// begin begins a unit of the store's for l on ctx, which the caller keeps
// from being canceled with a client (OpBegin), waiting at most
// storeTimeout for the store to begin it. The unit lives until it is
// written or ended, however long the work in it takes, so its context
// (which a SQL transaction keeps for its whole life) has no deadline: it is
// canceled only while Begin has not returned after storeTimeout, and while
// Commit has not (write).
func (g gateway) begin(ctx context.Context, l Lease) (*openUnit, error) {
	start := time.Now()
	bctx, abort := context.WithCancelCause(ctx)
	timer := time.AfterFunc(storeTimeout, func() { abort(errBeginTimeout) })
	u, uctx, err := g.tx.Begin(bctx, l)
	late := !timer.Stop() // the wait ran out: bctx is canceled, and the unit with it
	if late {
		err = errBeginTimeout
	}
	g.obs.storeCall(ctx, OpBegin, l.Scope, start, err)
	if err != nil {
		if u != nil {
			g.end(ctx, &openUnit{Unit: u, lease: l, ctx: uctx, abort: abort, inTx: true})
		}
		abort(nil)
		return nil, err
	}
	return &openUnit{Unit: u, lease: l, ctx: uctx, abort: abort, inTx: true}, nil
}

// write makes the writes of u (write, then Commit) as a call of kind k
// (of an auto-commit unit) or inUnit (of a unit of the store's), within
// one call's bound, and ends u. When the call runs out during a Commit, the context u was
// begun with (which a SQL transaction keeps, and its COMMIT with it) is
// canceled. When the outcome is unknown (a lost connection, a commit whose
// answer was lost), applied reads the record, whose owner and generation
// tell whose write it holds, and write returns nil when it says the write
// applied.
func (g gateway) write(ctx context.Context, k, inUnit kind, u *openUnit,
	write func(ctx context.Context) error, applied func(rec Record, err error) bool) error {
	if u.inTx {
		k = inUnit
	}
	err, unknown := g.try(ctx, k, u.lease.Scope, func(ctx context.Context) error {
		if err := write(ctx); err != nil {
			return err
		}
		if u.abort != nil {
			defer context.AfterFunc(ctx, func() { u.abort(errCommitTimeout) })()
		}
		u.ended = true // a Commit, applied or not, ends the unit
		return u.Commit()
	})
	g.end(ctx, u)
	if err != nil && unknown && g.readBack(ctx, u.lease.Scope, applied) {
		return nil
	}
	return err
}

// end ends u if nothing ended it yet: the one place where a unit is rolled
// back (OpRollback, for a unit of the store's), whichever way the work in
// it stopped: a write that failed, a phase whose function failed or
// panicked, an answer that is not stored, a Begin too late.
func (g gateway) end(ctx context.Context, u *openUnit) {
	if !u.ended && u.inTx {
		start := time.Now()
		err := u.Rollback()
		g.obs.storeCall(ctx, OpRollback, u.lease.Scope, start, err)
	}
	u.ended = true
	if u.abort != nil {
		u.abort(nil)
	}
}
