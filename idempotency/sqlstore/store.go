package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/headercodec"
	"github.com/saferetry/saferetry/internal/scopedigest"
	"github.com/saferetry/saferetry/internal/unixnano"
)

// Errors returned by Open and by the Store's methods.
var (
	// ErrInvalidConfig is matched (errors.Is) by the error Open returns for
	// arguments it cannot use, whose message names the argument: a nil
	// *sql.DB, a Dialect other than Postgres, SQLite or MySQL, or a
	// WithTable name that is not a plain identifier of 1 to 48 ASCII
	// letters, digits or underscores that does not start with a digit.
	ErrInvalidConfig = errors.New("sqlstore: invalid config")
	// ErrSerialization is matched (errors.Is) by an *OpError whose cause is
	// a PostgreSQL serialization failure (SQLSTATE 40001) or deadlock
	// (40P01), or a MySQL deadlock (1213) or lock wait timeout (1205): a
	// retryable store error, not a lost lease, since nothing of the
	// statement committed. The Store runs a stand-alone statement up to
	// three times before returning it; a Unit returns it at once (its
	// transaction is gone).
	ErrSerialization = errors.New("sqlstore: serialization failure or deadlock")
	// ErrSQLiteBusyTimeout is returned by Open for a SQLite database whose
	// connection waits less than MinSQLiteBusyTimeoutMillis for the write
	// lock (SQLite's default, and database/sql's with a bare file name, is
	// 0: fail at once). Such a store answers 503 to a share of concurrent
	// requests with SQLITE_BUSY as soon as two of them write at once.
	ErrSQLiteBusyTimeout = errors.New("sqlstore: SQLite database without a busy timeout; " +
		`open it with sql.Open("sqlite", sqlstore.SQLiteDSN(path))`)
	// ErrSQLiteDeferredTx is returned by Open for a SQLite database whose
	// transactions begin deferred (without _txlock=immediate in the DSN):
	// a unit that reads before it writes then fails with SQLITE_BUSY, not
	// waiting for the busy timeout, as soon as another connection writes.
	ErrSQLiteDeferredTx = errors.New("sqlstore: SQLite transactions begin deferred; " +
		`open the database with sql.Open("sqlite", sqlstore.SQLiteDSN(path)) (_txlock=immediate)`)
)

// MinSQLiteBusyTimeoutMillis is the smallest busy_timeout Open accepts on a
// SQLite database (SQLiteDSN sets SQLiteBusyTimeoutMillis).
const MinSQLiteBusyTimeoutMillis = 1000

// OpError wraps a database error with the Store operation that met it
// ("open", "claim", "get", "heartbeat", "complete", "release", "set_recovery_point",
// "abandoned", "delete_before", "migrate", "begin", "commit", "rollback").
// The middleware treats such errors as "store unavailable". Use errors.As to
// read Op, errors.Is/As on it to reach the driver's error; errors.Is(err,
// ErrSerialization) tells a retryable serialization failure or deadlock.
type OpError struct {
	Op  string
	Err error
}

// Error returns "sqlstore: <op>: <cause>".
func (e *OpError) Error() string { return "sqlstore: " + e.Op + ": " + e.Err.Error() }

// Unwrap returns the underlying database error.
func (e *OpError) Unwrap() error { return e.Err }

// Is reports whether target is ErrSerialization and the cause is a
// serialization failure or deadlock.
func (e *OpError) Is(target error) bool {
	return target == ErrSerialization && isSerialization(e.Err)
}

// isSerialization reports whether err is a database error with SQLSTATE
// 40001 (serialization_failure) or 40P01 (deadlock_detected), or a MySQL
// deadlock or lock wait timeout (isMySQLRetryable). PostgreSQL drivers
// expose the SQLSTATE through a SQLState method (pgx's *pgconn.PgError,
// lib/pq's *pq.Error); the package imports no driver.
func isSerialization(err error) bool {
	if err == nil {
		return false
	}
	if isMySQLRetryable(err) {
		return true
	}
	var se interface{ SQLState() string }
	if !errors.As(err, &se) {
		return false
	}
	code := se.SQLState()
	return code == "40001" || code == "40P01"
}

// statementTries bounds how often a stand-alone statement runs when
// PostgreSQL rolls it back with a serialization failure or deadlock.
const statementTries = 3

// retried runs f, a statement in a transaction of its own, again while it
// fails with a serialization failure or deadlock: under a server default of
// REPEATABLE READ or SERIALIZABLE, a conditional write that waited for a row
// a concurrent takeover changed fails with SQLSTATE 40001 instead of seeing
// the new row, and running it again on a fresh snapshot gives the READ
// COMMITTED answer (usually ErrLeaseLost); on MySQL, claims of one key
// deadlock in InnoDB's duplicate check, and a statement that waited for a
// row lock longer than innodb_lock_wait_timeout fails. Nothing of a
// rolled-back statement committed, so running it again is safe. Statements
// of a Unit are never retried here.
func retried[T any](f func() (T, error)) (T, error) {
	var (
		v   T
		err error
	)
	for range statementTries {
		v, err = f()
		if !isSerialization(err) {
			break
		}
	}
	return v, err
}

// retriedErr is retried for statements that return only an error.
func retriedErr(f func() error) error {
	_, err := retried(func() (struct{}, error) { return struct{}{}, f() })
	return err
}

func opErr(op string, err error) error {
	if err == nil {
		return nil
	}
	return &OpError{Op: op, Err: err}
}

// Option configures Open.
type Option func(*config)

type config struct {
	table string
}

// WithTable sets the table name (default DefaultTable, "idempotency_records").
// The name must be a plain unquoted identifier: 1 to 48 ASCII letters,
// digits or underscores, not starting with a digit; Open returns an error
// matching ErrInvalidConfig otherwise. Two Stores with different tables in
// one database are independent, so long as no name is another's followed by
// one of the suffixes of the index names Schema gives ("_pending_idx",
// "_done_idx"; and "_v1", "_leases", "_created_idx", "_lease_idx" and
// "_updated_idx", which Migrate renames to or drops): tables and indexes
// share one namespace.
func WithTable(name string) Option {
	return func(c *config) { c.table = name }
}

// Store is an idempotency.Store and idempotency.Transactor over database/sql.
// It is safe for concurrent use by many goroutines and, with PostgreSQL or
// MySQL (or SQLite on one host, through the file's locks), by many
// processes sharing the same table. It never reads a clock: every time
// comes from its arguments.
type Store struct {
	db    *sql.DB
	stmts *stmtCache // runs the stand-alone statements on db
	d     dialect
	table string
	q     queries
}

var (
	_ idempotency.Store      = (*Store)(nil)
	_ idempotency.Transactor = (*Store)(nil)
)

// Open returns a Store over db, whose driver must speak d (for example
// sql.Open("pgx", dsn), sql.Open("sqlite", SQLiteDSN(path)) or
// sql.Open("mysql", dsn)). It does not change the database: call Migrate
// (or run Schema's DDL yourself) before use. It runs one query to identify
// the database and refuses one that d does not name (*DialectError). On
// SQLite it checks the pool's connections (those open and a new one): a
// busy timeout under MinSQLiteBusyTimeoutMillis is refused with
// ErrSQLiteBusyTimeout (a PRAGMA run through the *sql.DB reaches one
// connection only: set it in the DSN), transactions that begin deferred
// with ErrSQLiteDeferredTx; SQLiteDSN sets both right. On SQLite and MySQL
// the Store prepares its statements on db once: keep one Store per table.
// Errors: one matching ErrInvalidConfig (a nil db, an unknown dialect, a
// bad table name), *DialectError, ErrSQLiteBusyTimeout,
// ErrSQLiteDeferredTx, or an *OpError with Op "open" when a check cannot
// run (each is bounded by 10 seconds).
func Open(db *sql.DB, d Dialect, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: nil *sql.DB", ErrInvalidConfig)
	}
	impl := d.impl()
	if impl == nil {
		return nil, fmt.Errorf("%w: unknown dialect %v", ErrInvalidConfig, d)
	}
	c := config{table: DefaultTable}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	if !validTable(c.table) {
		return nil, fmt.Errorf("%w: table name %q is not a plain identifier of 1 to %d characters",
			ErrInvalidConfig, c.table, maxTableLen)
	}
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	defer cancel()
	if err := checkDialect(ctx, db, d); err != nil {
		return nil, err
	}
	if err := impl.check(ctx, db); err != nil {
		return nil, err
	}
	return &Store{
		db: db, stmts: &stmtCache{db: db, prepare: impl.prepared()},
		d: impl, table: c.table, q: impl.queries(c.table),
	}, nil
}

// Schema returns the DDL that Migrate runs for this Store's dialect and
// table: one CREATE TABLE IF NOT EXISTS whose primary key is scope_hash (the
// SHA-256 of the scope's parts, which are kept beside it) and the indexes
// of the completer's and the reaper's scans: on PostgreSQL and SQLite, two
// partial CREATE INDEX IF NOT EXISTS; on MySQL, two INDEX clauses of the
// CREATE TABLE, which is the whole DDL. Times are integer Unix nanoseconds
// (UTC) in every dialect.
func (s *Store) Schema() string { return s.d.schema(s.table) }

// splitStatements splits the DDL on its semicolons (the schema has none
// inside a statement).
func splitStatements(ddl string) []string {
	var out []string
	for _, stmt := range strings.Split(ddl, ";") {
		if stmt = strings.TrimSpace(stmt); stmt != "" {
			out = append(out, stmt)
		}
	}
	return out
}

// Claim implements idempotency.Store.Claim (see the package documentation,
// "Claims and fences"). Its first statement is an INSERT that creates the
// record when the scope has none and otherwise does nothing (a
// takeover-only claim skips it); a read then fetches the record to answer
// from (a replay, a conflict: two statements, nothing written); and only
// when the claim wins that record (an expired lease with the same
// fingerprint, a completion before the replay window) one more step wins
// it: a conditional UPDATE, or on MySQL a short locking transaction. It
// creates, restarts or takes over the record only if the row under the
// scope's digest holds the same scope parts, and otherwise changes
// nothing; every answer is the record as one statement saw it, at a moment
// between the call and its return. A record that changes between these
// statements so that the claim is undecided (it is gone, or no longer one
// the claim wins) makes the claim start over, at most three rounds. A row
// under the digest that holds another scope (a SHA-256 collision) is never
// changed: the claim fails. Errors are *OpError with Op "claim".
func (s *Store) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	for range claimRounds {
		res, decided, err := s.claimRound(ctx, s.stmts, c)
		if err != nil {
			return idempotency.ClaimResult{}, opErr("claim", err)
		}
		if decided {
			return res, nil
		}
	}
	return idempotency.ClaimResult{}, opErr("claim", errKeptChanging)
}

// claimRounds bounds the rounds of a claim.
const claimRounds = 3

var errKeptChanging = errors.New("the record kept changing between the claim's statements")

// claimRound runs one round of c, its statements on q (a stand-alone
// statement each, run again after a serialization failure, or statements
// of a transaction): it reports the answer and true, or false when the
// record changed between its statements in a way that leaves c undecided.
func (s *Store) claimRound(ctx context.Context, q execer, c idempotency.Claim) (
	idempotency.ClaimResult, bool, error) {
	if !c.TakeoverOnly {
		created, err := retried(func() (bool, error) { return s.d.claim(ctx, s, q, c) })
		if err != nil {
			return idempotency.ClaimResult{}, false, err
		}
		if created {
			return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated,
				Record: claimedRecord(c, 1)}, true, nil
		}
	}
	rec, err := retried(func() (idempotency.Record, error) {
		return scanExisting(q.QueryRowContext(ctx, s.q.existing, existingArgs(c.Scope)...), c.Scope)
	})
	switch {
	case errors.Is(err, sql.ErrNoRows): // released or reaped since the INSERT
		return idempotency.ClaimResult{}, c.TakeoverOnly, nil // nothing to take over
	case err != nil:
		return idempotency.ClaimResult{}, false, err
	case !wouldWin(rec, c):
		return idempotency.ClaimResult{Record: rec}, true, nil
	}
	res, err := retried(func() (idempotency.ClaimResult, error) {
		return s.d.win(ctx, s, q, c, rec)
	})
	switch {
	case errors.Is(err, sql.ErrNoRows): // it changed again
		return idempotency.ClaimResult{}, false, nil
	case err != nil:
		return idempotency.ClaimResult{}, false, err
	}
	return res, true, nil
}

// wouldWin reports whether c wins rec by the claim's conditions: rec is in
// progress with a lease that ended before c.Now and c's fingerprint and
// version, or (unless c is takeover-only) completed before the replay
// window's cutoff.
func wouldWin(rec idempotency.Record, c idempotency.Claim) bool {
	now := unixnano.Of(c.Now)
	switch rec.State {
	case idempotency.Completed:
		return !c.TakeoverOnly && c.ReplayWindow > 0 &&
			unixnano.Of(rec.CompletedAt) < unixnano.Add(c.Now, -c.ReplayWindow)
	case idempotency.InProgress:
		return unixnano.Of(rec.LeaseUntil) < now && rec.Fingerprint == c.Fingerprint &&
			rec.FingerprintVersion == c.FingerprintVersion
	}
	return false
}

// rowQueryer is what a read needs: *sql.Tx or the Store's stmtCache.
type rowQueryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// execer is what the writes need: *sql.Tx or the Store's stmtCache (MySQL's
// fenced writes may read after they write, see dialect.confirmMiss).
type execer interface {
	rowQueryer
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// scopeArgs are the arguments $1 to $5 of the claim statements: the digest
// and the four parts.
func scopeArgs(sc idempotency.Scope, more ...any) []any {
	return append([]any{scopeHash(sc), []byte(sc.Principal), []byte(sc.Method), []byte(sc.Route),
		[]byte(sc.Key)}, more...)
}

// existingArgs are the arguments of queries.existing: the four parts, then
// the digest.
func existingArgs(sc idempotency.Scope) []any {
	return []any{[]byte(sc.Principal), []byte(sc.Method), []byte(sc.Route), []byte(sc.Key),
		scopeHash(sc)}
}

// insertArgs are the twelve arguments of queries.insert (insertVals): the
// digest and the parts, the fingerprint and its version, the owner, the
// lease end, the request, and now twice (created and updated).
func (s *Store) insertArgs(c idempotency.Claim) []any {
	now := unixnano.Of(c.Now)
	return scopeArgs(c.Scope, s.d.text(c.Fingerprint), int64(c.FingerprintVersion),
		s.d.text(c.Owner), unixnano.Add(c.Now, c.LeaseFor), nullBytes(c.Request), now, now)
}

// claimArgs are the twelve arguments of PostgreSQL's and SQLite's restart,
// the first takeoverArgs of their takeover (see takeoverSet).
func claimArgs(c idempotency.Claim) []any {
	cutoff := int64(math.MinInt64) // ReplayWindow <= 0: completed records never expire
	if c.ReplayWindow > 0 {
		cutoff = unixnano.Add(c.Now, -c.ReplayWindow)
	}
	return scopeArgs(c.Scope, c.Fingerprint, int64(c.FingerprintVersion), c.Owner,
		unixnano.Add(c.Now, c.LeaseFor), unixnano.Of(c.Now), nullBytes(c.Request), cutoff)
}

// scanExisting reads the row of queries.existing: the record of sc a claim
// did not create, without its request and recovery data.
// errScopeMismatch when the row holds another scope.
func scanExisting(row scanner, sc idempotency.Scope) (idempotency.Record, error) {
	var (
		same             bool
		state, fpVersion int64
		lease, compl     int64
		status           sql.NullInt64
		header, body     []byte
		r                = idempotency.Record{Scope: sc}
	)
	if err := row.Scan(&same, &state, &r.Fingerprint, &fpVersion, &r.Owner, &r.Generation,
		&lease, &compl, &status, &header, &body); err != nil {
		return idempotency.Record{}, err
	}
	if !same {
		return idempotency.Record{}, errScopeMismatch
	}
	r.State, r.FingerprintVersion = idempotency.State(state), int(fpVersion)
	r.LeaseUntil, r.CompletedAt = unixnano.Time(lease), unixnano.Time(compl)
	if status.Valid {
		h, err := headercodec.Decode(header)
		if err != nil {
			return idempotency.Record{}, err
		}
		r.Response = &idempotency.Response{Status: int(status.Int64), Header: h, Body: body}
	}
	return r, nil
}

// claimedRecord is the record that claim c created with generation gen: the
// claim's own values.
func claimedRecord(c idempotency.Claim, gen int64) idempotency.Record {
	now := unixnano.Time(unixnano.Of(c.Now))
	return idempotency.Record{
		Scope: c.Scope, State: idempotency.InProgress, Fingerprint: c.Fingerprint,
		FingerprintVersion: c.FingerprintVersion, Owner: c.Owner, Generation: gen,
		LeaseUntil: unixnano.Time(unixnano.Add(c.Now, c.LeaseFor)), CreatedAt: now, UpdatedAt: now,
		Request: c.Request,
	}
}

// Get implements idempotency.Store.Get. It returns idempotency.ErrNotFound
// when no record exists, *OpError with Op "get" on database errors.
func (s *Store) Get(ctx context.Context, sc idempotency.Scope) (idempotency.Record, error) {
	rec, err := retried(func() (idempotency.Record, error) {
		return scanScope(sc, s.stmts.QueryRowContext(ctx, s.q.get, scopeHash(sc)))
	})
	if errors.Is(err, sql.ErrNoRows) {
		return idempotency.Record{}, idempotency.ErrNotFound
	}
	if err != nil {
		return idempotency.Record{}, opErr("get", err)
	}
	return rec, nil
}

// Heartbeat implements idempotency.Store.Heartbeat: it sets the lease end to
// until. idempotency.ErrLeaseLost when l does not own an in-progress record.
func (s *Store) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	return retriedErr(func() error { return s.heartbeat(ctx, s.stmts, l, until) })
}

// Complete implements idempotency.Store.Complete outside any transaction.
// idempotency.ErrLeaseLost when l does not own an in-progress record.
func (s *Store) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	return retriedErr(func() error { return s.complete(ctx, s.stmts, l, resp, now) })
}

// Release implements idempotency.Store.Release: it deletes the in-progress
// record l owns. idempotency.ErrLeaseLost when l does not own it.
func (s *Store) Release(ctx context.Context, l idempotency.Lease) error {
	return retriedErr(func() error { return s.release(ctx, s.stmts, l) })
}

// SetRecoveryPoint implements idempotency.Store.SetRecoveryPoint outside any
// transaction. idempotency.ErrLeaseLost when l does not own an in-progress
// record.
func (s *Store) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string,
	data []byte, now time.Time) error {
	return retriedErr(func() error { return s.setPoint(ctx, s.stmts, l, point, data, now) })
}

// Abandoned implements idempotency.Sweeper.Abandoned: up to limit in-progress
// records whose lease ended before now, the longest-expired first. A limit
// of 0 or less returns nothing.
func (s *Store) Abandoned(ctx context.Context, now time.Time, limit int) (
	[]idempotency.Record, error) {
	if limit <= 0 {
		return nil, nil
	}
	return retried(func() ([]idempotency.Record, error) { return s.abandoned(ctx, now, limit) })
}

func (s *Store) abandoned(ctx context.Context, now time.Time, limit int) (
	[]idempotency.Record, error) {
	rows, err := s.db.QueryContext(ctx, s.q.abandoned, unixnano.Of(now), int64(limit))
	if err != nil {
		return nil, opErr("abandoned", err)
	}
	defer func() { _ = rows.Close() }()
	var out []idempotency.Record
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, opErr("abandoned", err)
		}
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, opErr("abandoned", err)
	}
	return out, nil
}

// DeleteBefore implements idempotency.Sweeper.DeleteBefore with one bounded
// DELETE: up to limit records last updated before horizon that are completed
// or whose lease also ended before horizon, the completed ones first,
// oldest first. On PostgreSQL it skips records that a concurrent write
// holds locked rather than wait for them (a later run finds them if they
// are still stale), and re-checks the conditions on each row it deletes, so
// a record taken over, heartbeated or completed meanwhile survives. On
// MySQL it is two statements, a plain read of the candidates and a DELETE
// of those by primary key that re-checks them, and it waits for a record a
// running write holds (see the package documentation, "MySQL and MariaDB").
// A limit of 0 or less deletes nothing. Errors are *OpError with Op
// "delete_before".
func (s *Store) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	n, err := s.d.deleteBefore(ctx, s, unixnano.Of(horizon), int64(limit))
	return n, opErr("delete_before", err)
}

func (s *Store) heartbeat(ctx context.Context, ex execer, l idempotency.Lease,
	until time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.heartbeat, unixnano.Of(until), scopeHash(l.Scope),
		s.d.text(l.Owner), l.Generation)
	return s.fenced(ctx, ex, "heartbeat", l, res, err)
}

func (s *Store) complete(ctx context.Context, ex execer, l idempotency.Lease,
	resp idempotency.Response, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.complete, int64(resp.Status),
		nullBytes(headercodec.Encode(resp.Header)), nullBytes(resp.Body), unixnano.Of(now),
		unixnano.Of(now), scopeHash(l.Scope), s.d.text(l.Owner), l.Generation)
	return s.fenced(ctx, ex, "complete", l, res, err)
}

func (s *Store) release(ctx context.Context, ex execer, l idempotency.Lease) error {
	res, err := ex.ExecContext(ctx, s.q.release, scopeHash(l.Scope), s.d.text(l.Owner),
		l.Generation)
	return s.fenced(ctx, ex, "release", l, res, err)
}

func (s *Store) setPoint(ctx context.Context, ex execer, l idempotency.Lease, point string,
	data []byte, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.setPoint, []byte(point), nullBytes(data), unixnano.Of(now),
		scopeHash(l.Scope), s.d.text(l.Owner), l.Generation)
	return s.fenced(ctx, ex, "set_recovery_point", l, res, err)
}

// fenced turns the result of a write fenced on l into nil, ErrLeaseLost (no
// row matched the fence) or an *OpError. A write that changed no row asks
// the dialect whether l still holds the record (dialect.confirmMiss).
func (s *Store) fenced(ctx context.Context, ex execer, op string, l idempotency.Lease,
	res sql.Result, err error) error {
	if err != nil {
		return opErr(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return opErr(op, err)
	}
	if n > 0 {
		return nil
	}
	err = s.d.confirmMiss(ctx, s, ex, l)
	if errors.Is(err, idempotency.ErrLeaseLost) {
		return err
	}
	return opErr(op, err)
}

type scanner interface{ Scan(dest ...any) error }

// errScopeMismatch is the cause of the *OpError a read returns when the row
// found under a scope's digest holds other scope parts: a SHA-256 collision,
// or a row written by something other than this package.
var errScopeMismatch = errors.New(
	"the stored record's scope differs from the one asked for (digest collision?)")

// scanScope scans a record read by sc's digest and checks that it is sc's.
func scanScope(sc idempotency.Scope, row scanner) (idempotency.Record, error) {
	rec, err := scanRecord(row)
	if err == nil && rec.Scope != sc {
		return idempotency.Record{}, errScopeMismatch
	}
	return rec, err
}

// scopeHash returns the record's primary key: the scope's digest
// (scopedigest.Sum).
func scopeHash(sc idempotency.Scope) []byte {
	d := scopedigest.Sum(sc.Principal, sc.Method, sc.Route, sc.Key)
	return d[:]
}

// scanRecord scans the columns of a record.
func scanRecord(sc scanner) (idempotency.Record, error) {
	var (
		r                                     idempotency.Record
		state, fpVersion                      int64
		leaseUntil, created, updated, complAt int64
		status                                sql.NullInt64
		principal, method, route, key, point  []byte
		header, recoveryData, request, body   []byte
	)
	err := sc.Scan(&principal, &method, &route, &key, &state,
		&r.Fingerprint, &fpVersion, &r.Owner, &r.Generation, &leaseUntil, &point,
		&recoveryData, &request, &status, &header, &body, &created, &updated, &complAt)
	if err != nil {
		return idempotency.Record{}, err
	}
	r.Scope = idempotency.Scope{Principal: string(principal), Method: string(method),
		Route: string(route), Key: string(key)}
	r.State = idempotency.State(state)
	r.FingerprintVersion = int(fpVersion)
	r.LeaseUntil = unixnano.Time(leaseUntil)
	r.RecoveryPoint = string(point)
	r.RecoveryData = recoveryData
	r.Request = request
	r.CreatedAt = unixnano.Time(created)
	r.UpdatedAt = unixnano.Time(updated)
	r.CompletedAt = unixnano.Time(complAt)
	if status.Valid {
		h, err := headercodec.Decode(header)
		if err != nil {
			return idempotency.Record{}, err
		}
		r.Response = &idempotency.Response{Status: int(status.Int64), Header: h, Body: body}
	}
	return r, nil
}

// nullBytes passes nil as SQL NULL and anything else as a blob.
func nullBytes(b []byte) any {
	if b == nil {
		return nil
	}
	return b
}
