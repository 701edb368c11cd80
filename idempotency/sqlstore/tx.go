package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

type unitKey struct{}

// Tx returns the transaction in which the handler's writes at ctx belong,
// and whether there is one:
//
//   - inside an atomic phase (idempotency.Run.Phase), the phase's
//     transaction, which commits with the phase's recovery point;
//   - elsewhere in a guarded handler, the request's transaction, which
//     commits together with the stored response: both land, or neither does.
//
// The transaction begins at the first call, not before: a handler or a
// phase that never calls Tx holds no transaction (on SQLite, no write
// lock) while it works, and its record write commits on its own. Call Tx
// when you are about to write, and after the handler's last phase. The
// first call waits at most 10 seconds for a connection. Under
// idempotency.WithOneTransaction the request's transaction began with the
// claim (see ClaimInUnit), and Tx returns it.
//
// It returns false outside a guarded handler, with a store other than this
// package's, or when the transaction could not be begun (the request then
// answers 503 CodeStoreUnavailable whatever the handler writes). The handler
// must not call Commit or Rollback on it. On PostgreSQL a statement that
// fails aborts the transaction: nothing of it can commit, the response is
// not stored and the request answers 503 CodeStoreUnavailable; run a
// statement that may fail, and whose failure the handler answers, in a
// SAVEPOINT it rolls back to on error. On SQLite, write only through this
// transaction while it is open, never through the *sql.DB: the unit holds
// the database's write lock, so a write on another connection waits for the
// busy timeout and then fails. Tx is safe for concurrent use, but the
// *sql.Tx itself belongs to the request's goroutine.
func Tx(ctx context.Context) (*sql.Tx, bool) {
	u, ok := ctx.Value(unitKey{}).(*unit)
	if !ok {
		run, isRun := idempotency.FromContext(ctx)
		if !isRun {
			return nil, false
		}
		_, uctx, err := run.Unit(ctx)
		if err != nil {
			return nil, false
		}
		if u, ok = uctx.Value(unitKey{}).(*unit); !ok {
			return nil, false
		}
	}
	tx, err := u.begin()
	return tx, err == nil
}

// beginTimeout bounds the wait of a unit's BEGIN for a connection.
const beginTimeout = 10 * time.Second

var errBeginTimeout = fmt.Errorf("no connection to begin a transaction on within %v: %w",
	beginTimeout, context.DeadlineExceeded)

// Begin implements idempotency.Transactor: it returns a Unit whose record
// writes are conditional on l, plus a context derived from ctx from which
// Tx returns the unit's transaction. It sends nothing: the transaction
// begins (bound to ctx as database/sql does: cancelling ctx rolls it back)
// at the first Tx call. A unit whose transaction never began applies its
// record write at Commit as one stand-alone conditional statement, and
// sends nothing at Rollback. Once the transaction has begun, its writes
// are conditional writes in it (nothing is locked before the first): a lost
// lease makes them return idempotency.ErrLeaseLost and rolls the whole unit
// back at once (the handler's writes included; Commit then returns
// idempotency.ErrLeaseLost as well). On PostgreSQL the transaction is READ
// COMMITTED whatever the server's default (see the package documentation);
// a serialization failure or deadlock in a unit's write or commit is an
// *OpError matching ErrSerialization, after which only Rollback is useful.
// On MySQL the transaction runs at the session's isolation level, which
// the fences do not depend on (see the package documentation, "MySQL and
// MariaDB"), and a deadlock or lock wait timeout matches ErrSerialization
// too. On SQLite open the database with SQLiteDSN (BEGIN IMMEDIATE): the
// transaction then holds the database's single write lock until Commit or
// Rollback. Begin never fails; a BEGIN that fails, or finds no connection
// within 10 seconds, is an *OpError with Op "begin", returned by the unit's
// later writes and its Commit.
func (s *Store) Begin(ctx context.Context, l idempotency.Lease) (
	idempotency.Unit, context.Context, error) {
	u := &unit{s: s, ctx: ctx, lease: l}
	return u, context.WithValue(ctx, unitKey{}, u), nil
}

// unit is one transaction bound to a lease, begun at the first Tx call.
// Until then its record writes wait in pending, for Commit. When a
// conditional write finds the lease lost, the unit rolls itself back at
// once (it can never commit anything useful, and on SQLite it would
// otherwise keep the write lock that the lease's successor needs); later
// writes and Commit then return idempotency.ErrLeaseLost too.
type unit struct {
	s     *Store
	ctx   context.Context // Begin's: the transaction's
	lease idempotency.Lease
	conn  *sql.Conn // the claim's (ClaimInUnit), closed when the unit ends; else nil

	mu      sync.Mutex // Tx may begin the transaction from another goroutine
	tx      *sql.Tx    // nil until begun
	cancel  context.CancelCauseFunc
	err     error                // the BEGIN's error, for good
	pending []func(execer) error // record writes asked for before the transaction began
	lost    bool
	done    bool // committed or rolled back
}

// begin begins the unit's transaction if it has not begun, waiting at most
// beginTimeout for a connection. The transaction's context is Begin's,
// canceled only when the unit ends.
func (u *unit) begin() (*sql.Tx, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch {
	case u.tx != nil || u.err != nil:
		return u.tx, u.err
	case u.lost:
		return nil, idempotency.ErrLeaseLost
	case u.done:
		return nil, sql.ErrTxDone
	}
	ctx, cancel := context.WithCancelCause(u.ctx)
	timer := time.AfterFunc(beginTimeout, func() { cancel(errBeginTimeout) })
	tx, err := u.s.db.BeginTx(ctx, u.s.d.txOptions())
	if !timer.Stop() { // the wait ran out: ctx is canceled, and tx with it
		if err == nil {
			_ = tx.Rollback()
		}
		err = context.Cause(ctx)
	}
	if err != nil {
		cancel(nil)
		u.err = opErr("begin", err)
		return nil, u.err
	}
	u.tx, u.cancel = tx, cancel
	return tx, nil
}

// write runs a conditional record write in the transaction, or keeps it for
// Commit when the transaction has not begun.
func (u *unit) write(w func(execer) error) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch {
	case u.lost:
		return idempotency.ErrLeaseLost
	case u.err != nil:
		return u.err
	case u.done:
		return sql.ErrTxDone
	case u.tx == nil:
		u.pending = append(u.pending, w)
		return nil
	}
	if err := u.flush(); err != nil {
		return err
	}
	return u.fenced(w(u.tx))
}

// flush runs in the transaction, in order, the writes asked for before it
// began. u.mu is held and u.tx set.
func (u *unit) flush() error {
	for len(u.pending) > 0 {
		w := u.pending[0]
		u.pending = u.pending[1:]
		if err := u.fenced(w(u.tx)); err != nil {
			return err
		}
	}
	return nil
}

// fenced rolls the unit back at its first ErrLeaseLost. u.mu is held.
func (u *unit) fenced(err error) error {
	if errors.Is(err, idempotency.ErrLeaseLost) && !u.lost {
		u.lost = true
		u.end(false)
	}
	return err
}

// end commits or rolls back the transaction, if it began, and releases its
// context. u.mu is held.
func (u *unit) end(commit bool) error {
	u.done, u.pending = true, nil
	if u.tx == nil {
		return nil
	}
	defer u.cancel(nil)
	if u.conn != nil {
		defer func() { _ = u.conn.Close() }()
	}
	if commit {
		return u.tx.Commit()
	}
	return u.tx.Rollback()
}

func (u *unit) SetRecoveryPoint(ctx context.Context, point string, data []byte,
	now time.Time) error {
	return u.write(func(ex execer) error {
		return u.s.setPoint(ctx, ex, u.lease, point, data, now)
	})
}

func (u *unit) Complete(ctx context.Context, resp idempotency.Response, now time.Time) error {
	return u.write(func(ex execer) error { return u.s.complete(ctx, ex, u.lease, resp, now) })
}

// Commit commits the transaction, or applies the writes asked for before
// any began: one as a stand-alone statement (run again after a
// serialization failure, as the Store's own are), several in a transaction
// begun now.
func (u *unit) Commit() error {
	u.mu.Lock()
	switch {
	case u.lost:
		u.mu.Unlock()
		return idempotency.ErrLeaseLost
	case u.err != nil:
		u.mu.Unlock()
		return u.err
	case u.done:
		u.mu.Unlock()
		return sql.ErrTxDone
	case u.tx == nil && len(u.pending) == 1:
		w := u.pending[0]
		u.done, u.pending = true, nil
		u.mu.Unlock()
		return retriedErr(func() error { return w(u.s.stmts) })
	}
	several := u.tx == nil && len(u.pending) > 1
	u.mu.Unlock()
	if several {
		if _, err := u.begin(); err != nil {
			return err
		}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.tx != nil {
		if err := u.flush(); err != nil {
			return err
		}
	}
	return opErr("commit", u.end(true))
}

func (u *unit) Rollback() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return nil
	}
	err := u.end(false)
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return opErr("rollback", err)
}

// minClaimWait is the shortest wait of ClaimInUnit on a key another
// transaction holds.
const minClaimWait = time.Second

// ClaimInUnit implements idempotency.ClaimTransactor, for
// idempotency.WithOneTransaction: it begins a transaction and in it
// creates c's record when the scope has none; the Unit it then returns
// holds that transaction, which Tx returns to the handler, and its
// Complete and Commit complete the record with the handler's writes, in
// one commit. Until then no other connection sees the record: a claim of
// the same key waits for the transaction to end, then finds the completed
// record, or none. The wait is bounded by wait, at least 1 s, on
// PostgreSQL (the transaction's lock_timeout, reset for the handler's
// statements) and on MySQL (the session's innodb_lock_wait_timeout, in
// whole seconds, restored likewise); either way the error then matches
// idempotency.ErrInProgress. The floor is there because the bound ends
// any lock wait of the claim's INSERT, which under load waits for other
// locks than the key's (PostgreSQL's relation extension lock): shorter,
// it answers fresh keys in progress. On SQLite
// the transaction begins IMMEDIATE: it waits for the database's write
// lock up to the busy timeout, whichever key its holder claimed.
//
// A scope that has a record ends the transaction: ClaimInUnit answers as
// Claim would, from the record read in it, or, when c would take it over
// or restart it (or it vanished), with a zero Record for the caller to
// Claim. A claim of the same key that deadlocks (MySQL) is made again, up
// to three times. Statements, on PostgreSQL: BEGIN and the INSERT; the
// completion is the unit's UPDATE and COMMIT. On MySQL two more, which set
// and restore the lock wait. Errors are *OpError with Op "claim".
func (s *Store) ClaimInUnit(ctx context.Context, c idempotency.Claim, wait time.Duration) (
	idempotency.ClaimResult, idempotency.Unit, context.Context, error) {
	if c.TakeoverOnly {
		res, err := s.Claim(ctx, c)
		return res, nil, ctx, err
	}
	var err error
	for range statementTries {
		var (
			res idempotency.ClaimResult
			u   *unit
		)
		res, u, err = s.claimInUnit(ctx, c, wait)
		switch {
		case err == nil && u != nil:
			return res, u, context.WithValue(ctx, unitKey{}, u), nil
		case err == nil:
			return res, nil, ctx, nil
		case s.d.heldPastWait(err):
			return idempotency.ClaimResult{}, nil, ctx, fmt.Errorf(
				"%w: another transaction holds the key: %w", idempotency.ErrInProgress,
				opErr("claim", err))
		case !isSerialization(err):
			return idempotency.ClaimResult{}, nil, ctx, opErr("claim", err)
		}
	}
	return idempotency.ClaimResult{}, nil, ctx, opErr("claim", err)
}

// errSessionChanged marks an error of claimInTx after which the
// connection may keep a session setting the claim changed.
var errSessionChanged = errors.New("sqlstore: the claim could not restore its session's setting")

// claimInUnit is one try of ClaimInUnit: the unit that holds the record
// it created, or its answer without a unit (the transaction ended). The
// transaction runs on a connection of its own (sql.Conn), so that one whose
// session a failed claim left changed is discarded, not pooled.
func (s *Store) claimInUnit(ctx context.Context, c idempotency.Claim, wait time.Duration) (
	idempotency.ClaimResult, *unit, error) {
	tctx, cancel := context.WithCancelCause(ctx)
	conn, err := s.db.Conn(tctx)
	if err != nil {
		cancel(nil)
		return idempotency.ClaimResult{}, nil, err
	}
	tx, err := conn.BeginTx(tctx, s.d.txOptions())
	if err != nil {
		_ = conn.Close()
		cancel(nil)
		return idempotency.ClaimResult{}, nil, err
	}
	created, err := s.d.claimInTx(tctx, s, tx, c, wait)
	if err == nil && created {
		u := &unit{s: s, ctx: ctx, tx: tx, cancel: cancel, conn: conn,
			lease: idempotency.Lease{Scope: c.Scope, Owner: c.Owner, Generation: 1}}
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated,
			Record: claimedRecord(c, 1)}, u, nil
	}
	var res idempotency.ClaimResult
	if err == nil {
		var rec idempotency.Record
		rec, err = scanExisting(tx.QueryRowContext(tctx, s.q.existing,
			existingArgs(c.Scope)...), c.Scope)
		switch {
		case errors.Is(err, sql.ErrNoRows): // gone since the INSERT: the caller claims
			err = nil
		case err == nil && !wouldWin(rec, c):
			res.Record = rec
		}
	}
	_ = tx.Rollback()
	if errors.Is(err, errSessionChanged) {
		_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // closes it
	}
	_ = conn.Close()
	cancel(nil)
	return res, nil, err
}
