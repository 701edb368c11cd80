package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

type txKey struct{}

// Tx returns the transaction in which the handler's writes at ctx belong,
// and whether there is one:
//
//   - inside an atomic phase (idempotency.Run.Phase), the phase's
//     transaction, which commits with the phase's recovery point;
//   - elsewhere in a guarded handler, the request's transaction, which
//     commits together with the stored response: both land, or neither does.
//     The middleware begins it on the first call (Run.Unit), not before the
//     handler runs, so that a handler holds no transaction (on SQLite, no
//     write lock) until it writes; call Tx after the handler's last phase.
//
// It returns false outside a guarded handler, with a store other than this
// package's, or when the transaction could not be begun (the request then
// answers 503 CodeStoreUnavailable whatever the handler writes). The handler
// must not call Commit or Rollback on it. On SQLite, write only through this
// transaction while it is open, never through the *sql.DB: the unit holds
// the database's write lock, so a write on another connection waits for the
// busy timeout and then fails. Tx is safe for concurrent use, but the
// *sql.Tx itself belongs to the request's goroutine.
func Tx(ctx context.Context) (*sql.Tx, bool) {
	if tx, ok := ctx.Value(txKey{}).(*sql.Tx); ok {
		return tx, tx != nil
	}
	run, ok := idempotency.FromContext(ctx)
	if !ok {
		return nil, false
	}
	_, uctx, err := run.Unit(ctx)
	if err != nil {
		return nil, false
	}
	tx, ok := uctx.Value(txKey{}).(*sql.Tx)
	return tx, ok && tx != nil
}

// WithTx returns a copy of ctx that carries tx for Tx. Begin does this
// itself; WithTx exists for code that drives its own transactions (tests,
// a completer reusing a handler).
func WithTx(ctx context.Context, tx *sql.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// Begin implements idempotency.Transactor: it starts a database transaction
// (bound to ctx as database/sql does: cancelling ctx rolls it back) and
// returns a Unit whose record writes are conditional on l, plus a context
// derived from ctx from which Tx returns the transaction. Nothing is locked
// at Begin on PostgreSQL: the fence is checked by the Unit's conditional
// writes: a lost lease makes them return idempotency.ErrLeaseLost and rolls
// the whole unit back at once (the handler's writes included; Commit then
// returns idempotency.ErrLeaseLost as well). On PostgreSQL the transaction
// is READ COMMITTED whatever the server's default (see the package
// documentation); a serialization failure or deadlock in a unit's write or
// commit is an *OpError matching ErrSerialization, after which only
// Rollback is useful. On MySQL the transaction runs at the session's
// isolation level, which the fences do not depend on (see the package
// documentation, "MySQL and MariaDB"). On SQLite open the database with SQLiteDSN (BEGIN
// IMMEDIATE): the unit then holds the database's single write lock until
// Commit or Rollback. Errors are *OpError with Op "begin".
func (s *Store) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit, context.Context, error) {
	tx, err := s.db.BeginTx(ctx, s.txOptions())
	if err != nil {
		return nil, ctx, opErr("begin", err)
	}
	return &unit{s: s, tx: tx, lease: l}, WithTx(ctx, tx), nil
}

// txOptions are the options of a unit's transaction. PostgreSQL units run
// READ COMMITTED whatever the server's or session's default: the fence
// relies on a conditional write that waited for a row changed by a
// concurrent takeover re-reading the row and matching nothing (ErrLeaseLost),
// where REPEATABLE READ or SERIALIZABLE fail it with SQLSTATE 40001. SQLite
// transactions are serializable anyway (one writer at a time); the
// modernc.org/sqlite driver ignores the isolation level, so SQLite keeps the
// driver's default (nil).
func (s *Store) txOptions() *sql.TxOptions {
	if s.dialect == Postgres {
		return &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	return nil
}

// unit is one transaction bound to a lease. When a conditional write finds
// the lease lost, the unit rolls itself back at once (it can never commit
// anything useful, and on SQLite it would otherwise keep the write lock that
// the lease's successor needs); later writes and Commit then return
// idempotency.ErrLeaseLost too.
type unit struct {
	s     *Store
	tx    *sql.Tx
	lease idempotency.Lease
	lost  bool
}

func (u *unit) fenced(err error) error {
	if errors.Is(err, idempotency.ErrLeaseLost) && !u.lost {
		u.lost = true
		_ = u.tx.Rollback()
	}
	return err
}

func (u *unit) SetRecoveryPoint(ctx context.Context, point string, data []byte, now time.Time) error {
	if u.lost {
		return idempotency.ErrLeaseLost
	}
	return u.fenced(u.s.setPoint(ctx, u.tx, u.lease, point, data, now))
}

func (u *unit) Complete(ctx context.Context, resp idempotency.Response, now time.Time) error {
	if u.lost {
		return idempotency.ErrLeaseLost
	}
	return u.fenced(u.s.complete(ctx, u.tx, u.lease, resp, now))
}

func (u *unit) Commit() error {
	if u.lost {
		return idempotency.ErrLeaseLost
	}
	return opErr("commit", u.tx.Commit())
}

func (u *unit) Rollback() error {
	err := u.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return opErr("rollback", err)
}
