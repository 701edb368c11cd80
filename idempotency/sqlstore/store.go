package sqlstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// Errors returned by Open and by the Store's methods.
var (
	// ErrNilDB is returned by Open when db is nil.
	ErrNilDB = errors.New("sqlstore: nil *sql.DB")
	// ErrUnknownDialect is returned by Open for a Dialect other than
	// Postgres or SQLite.
	ErrUnknownDialect = errors.New("sqlstore: unknown dialect")
	// ErrInvalidTable is returned by Open when the WithTable name is not a
	// plain identifier of 1 to 48 ASCII letters, digits or underscores that
	// does not start with a digit.
	ErrInvalidTable = errors.New("sqlstore: invalid table name")
	// ErrSerialization is matched (errors.Is) by an *OpError whose cause is
	// a PostgreSQL serialization failure (SQLSTATE 40001) or deadlock
	// (40P01), recognised through the driver error's SQLState method. It is a
	// retryable store error, not a lost lease: the database rolled back the
	// statement's transaction, so nothing of it committed, and the lease is
	// still the caller's. The Store runs its stand-alone statements (every
	// method but those of a Unit) again on a fresh snapshot, up to three
	// times, before returning it; a Unit returns it at once, since its whole
	// transaction is gone (the middleware then answers 503 and gives the key
	// up, so the client's retry runs the request again).
	ErrSerialization = errors.New("sqlstore: serialization failure or deadlock")
	// ErrSQLiteBusyTimeout is returned by Open for a SQLite database whose
	// connection waits less than MinSQLiteBusyTimeoutMillis for the write
	// lock (SQLite's default, and database/sql's with a bare file name, is
	// 0: fail at once). Such a store answers 503 to a share of concurrent
	// requests with SQLITE_BUSY as soon as two of them write at once.
	ErrSQLiteBusyTimeout = errors.New(`sqlstore: SQLite database without a busy timeout; open it with sql.Open("sqlite", sqlstore.SQLiteDSN(path))`)
	// ErrSQLiteDeferredTx is returned by Open for a SQLite database whose
	// transactions begin deferred (without _txlock=immediate in the DSN):
	// a unit that reads before it writes then fails with SQLITE_BUSY, not
	// waiting for the busy timeout, as soon as another connection writes.
	ErrSQLiteDeferredTx = errors.New(`sqlstore: SQLite transactions begin deferred; open the database with sql.Open("sqlite", sqlstore.SQLiteDSN(path)) (_txlock=immediate)`)
)

// MinSQLiteBusyTimeoutMillis is the smallest busy_timeout Open accepts on a
// SQLite database (SQLiteDSN sets SQLiteBusyTimeoutMillis).
const MinSQLiteBusyTimeoutMillis = 1000

// OpError wraps a database error with the Store operation that met it
// ("claim", "get", "heartbeat", "complete", "release", "set_recovery_point",
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
// 40001 (serialization_failure) or 40P01 (deadlock_detected). Drivers expose
// it through a SQLState method (pgx's *pgconn.PgError, lib/pq's *pq.Error);
// the package imports no driver.
func isSerialization(err error) bool {
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
// COMMITTED answer (usually ErrLeaseLost). Nothing of a rolled-back
// statement committed, so running it again is safe. Statements of a Unit are
// never retried here.
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
// digits or underscores, not starting with a digit; Open returns
// ErrInvalidTable otherwise. Two Stores with different tables in one database
// are independent.
func WithTable(name string) Option {
	return func(c *config) { c.table = name }
}

// Store is an idempotency.Store and idempotency.Transactor over database/sql.
// It is safe for concurrent use by many goroutines and, with PostgreSQL (or
// SQLite on one host, through the file's locks), by many processes sharing
// the same table. It never reads a clock: every time comes from its
// arguments.
type Store struct {
	db      *sql.DB
	stmts   *stmtCache // runs the stand-alone statements on db
	dialect Dialect
	table   string
	q       queries
}

var (
	_ idempotency.Store      = (*Store)(nil)
	_ idempotency.Transactor = (*Store)(nil)
)

// Open returns a Store over db, which must be opened with a driver for d
// (for example sql.Open("pgx", dsn) or sql.Open("sqlite", SQLiteDSN(path))).
// Open does not change the database; call Migrate (or run Schema's DDL
// yourself) before use. With SQLite it checks the pool's connections (those
// open and a new one): it refuses a database that waits less than
// MinSQLiteBusyTimeoutMillis for the write lock (ErrSQLiteBusyTimeout; a
// PRAGMA run through the *sql.DB reaches one connection only, so set
// busy_timeout in the DSN) and one whose transactions begin deferred
// (ErrSQLiteDeferredTx, no _txlock=immediate); both errors name SQLiteDSN,
// which sets everything. On SQLite the Store prepares its statements on db,
// once: make one Store per table and keep it. Errors: ErrNilDB,
// ErrUnknownDialect, ErrInvalidTable, ErrSQLiteBusyTimeout,
// ErrSQLiteDeferredTx, or an *OpError with Op "open" when the check cannot
// run.
func Open(db *sql.DB, d Dialect, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, ErrNilDB
	}
	if !d.valid() {
		return nil, fmt.Errorf("%w: %v", ErrUnknownDialect, d)
	}
	c := config{table: DefaultTable}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	if !validTable(c.table) {
		return nil, fmt.Errorf("%w: %q", ErrInvalidTable, c.table)
	}
	if d == SQLite {
		if err := checkSQLite(db); err != nil {
			return nil, err
		}
	}
	return &Store{db: db, stmts: &stmtCache{db: db, prepare: d == SQLite}, dialect: d, table: c.table, q: buildQueries(d, c.table)}, nil
}

// Schema returns the DDL that Migrate runs for this Store's dialect and
// table: one CREATE TABLE IF NOT EXISTS with the primary key on (principal,
// method, route, idem_key) and two CREATE INDEX IF NOT EXISTS (for the
// completer's and the reaper's scans). Times are stored as integer Unix
// nanoseconds (UTC) in both dialects.
func (s *Store) Schema() string { return schema(s.dialect, s.table) }

// Table returns the table name the Store uses.
func (s *Store) Table() string { return s.table }

// Dialect returns the Store's dialect.
func (s *Store) Dialect() Dialect { return s.dialect }

// splitStatements splits the DDL on the semicolons that end its lines (the
// schema text has no semicolon inside a statement).
func splitStatements(ddl string) []string {
	var out []string
	start := 0
	for i := 0; i < len(ddl); i++ {
		if ddl[i] == ';' {
			if stmt := trimSpace(ddl[start:i]); stmt != "" {
				out = append(out, stmt)
			}
			start = i + 1
		}
	}
	return out
}

func trimSpace(s string) string {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\n' || s[0] == '\t') {
		s = s[1:]
	}
	return s
}

// Claim implements idempotency.Store.Claim with one INSERT ... ON CONFLICT
// DO UPDATE ... WHERE ... RETURNING statement: no record inserts one
// (generation 1); a completed record that completed before Now-ReplayWindow
// starts over (generation+1, recovery point, response cleared, the new
// request stored; a ReplayWindow of 0 or less never expires a record); an
// in-progress record whose lease ended before Now with the same fingerprint
// and fingerprint version is taken over (generation+1, recovery point, data and
// request kept). Otherwise the same statement returns the existing record,
// (idempotency.ClaimExisting); it reads the record a second time only when the
// statement could not see its current version (on PostgreSQL, a concurrent
// insert or takeover that committed after the statement began). With
// c.TakeoverOnly the statement is one conditional
// UPDATE ... RETURNING instead, which only takes over such an expired
// in-progress record: it never inserts and never restarts a completed record
// (whatever ReplayWindow), and with no record it returns ClaimExisting with
// a zero Record. Errors are *OpError with Op "claim".
func (s *Store) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	rec, won, err := s.claim(ctx, c)
	if err != nil || !won {
		return idempotency.ClaimResult{Record: rec}, err
	}
	// The statement sets created_at to the claim's time only when it creates
	// the record (a new key, or a restart after the replay window); a
	// takeover keeps the first claim's, which is before Now (its lease
	// ended before Now).
	if c.TakeoverOnly || nanos(rec.CreatedAt) != nanos(c.Now) {
		return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: rec}, nil
	}
	return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: rec}, nil
}

// claim runs the claim and returns the record and whether the claim won it.
func (s *Store) claim(ctx context.Context, c idempotency.Claim) (idempotency.Record, bool, error) {
	// The loop only repeats when the row that beat our insert vanished
	// (released or reaped) before we could read it: then we claim again.
	for range 3 {
		var won bool
		rec, err := retried(func() (r idempotency.Record, err error) {
			r, won, err = s.claimRow(ctx, s.stmts, c)
			return r, err
		})
		if err == nil && (won || !wouldWin(rec, c)) {
			return rec, won, nil
		}
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return idempotency.Record{}, false, opErr("claim", err)
		}
		// Someone else holds the record, and the statement could not see
		// its current version: on PostgreSQL a concurrent insert or
		// takeover committed after the statement's snapshot was taken, so
		// the statement returned no row, or the row as it was before (one
		// this claim would have won, had it still been so); for a
		// takeover-only claim, the UPDATE matched nothing. This read decides
		// nothing: it only fetches what to answer.
		rec, err = s.Get(ctx, c.Scope)
		if err == nil {
			return rec, false, nil
		}
		if !errors.Is(err, idempotency.ErrNotFound) {
			return idempotency.Record{}, false, err
		}
		if c.TakeoverOnly {
			return idempotency.Record{}, false, nil // nothing to take over
		}
	}
	return idempotency.Record{}, false, opErr("claim", errors.New("record kept vanishing between claim and read"))
}

// wouldWin reports whether c wins rec by the claim statement's condition
// (claimWins). A record that a claim returned without being won, yet
// satisfies it, is an older version than the one the statement's conflict
// check saw: another claim won it meanwhile.
func wouldWin(rec idempotency.Record, c idempotency.Claim) bool {
	now := nanos(c.Now)
	switch rec.State {
	case idempotency.Completed:
		return c.ReplayWindow > 0 && nanos(rec.CompletedAt) < subSat(now, c.ReplayWindow)
	case idempotency.InProgress:
		return nanos(rec.LeaseUntil) < now && rec.Fingerprint == c.Fingerprint &&
			rec.FingerprintVersion == c.FingerprintVersion
	}
	return false
}

// rowQueryer is what the claim statement needs: *sql.DB or *sql.Tx.
type rowQueryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// claimRow runs the claim statement once on q (the takeover-only UPDATE
// when c.TakeoverOnly) and scans the row it returns and whether the claim
// won it: sql.ErrNoRows when the statement returned nothing (the
// takeover-only claim did not win, or the claim could not see the record
// that beat it).
func (s *Store) claimRow(ctx context.Context, q rowQueryer, c idempotency.Claim) (rec idempotency.Record, won bool, err error) {
	now := nanos(c.Now)
	leaseUntil := nanos(c.Now.Add(c.LeaseFor))
	sc := c.Scope
	if c.TakeoverOnly {
		rec, err = scanScope(sc, q.QueryRowContext(ctx, s.q.takeover,
			scopeHash(sc), c.Owner, leaseUntil, now, c.Fingerprint, int64(c.FingerprintVersion)), &won)
		return rec, won, err
	}
	cutoff := int64(math.MinInt64) // ReplayWindow <= 0: completed records never expire
	if c.ReplayWindow > 0 {
		cutoff = subSat(now, c.ReplayWindow)
	}
	rec, err = scanScope(sc, q.QueryRowContext(ctx, s.q.claim,
		scopeHash(sc), []byte(sc.Principal), []byte(sc.Method), []byte(sc.Route), []byte(sc.Key),
		c.Fingerprint, int64(c.FingerprintVersion), c.Owner, leaseUntil, nullBytes(c.Request), now,
		cutoff), &won)
	return rec, won, err
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

// EndLease implements idempotency.Store.EndLease with the heartbeat's
// statement: it sets the lease end to now. idempotency.ErrLeaseLost when l
// does not own an in-progress record.
func (s *Store) EndLease(ctx context.Context, l idempotency.Lease, now time.Time) error {
	return retriedErr(func() error { return s.heartbeat(ctx, s.stmts, l, now) })
}

// Complete implements idempotency.Store.Complete outside any transaction.
// idempotency.ErrLeaseLost when l does not own an in-progress record.
func (s *Store) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response, now time.Time) error {
	return retriedErr(func() error { return s.complete(ctx, s.stmts, l, resp, now) })
}

// Release implements idempotency.Store.Release: it deletes the in-progress
// record l owns. idempotency.ErrLeaseLost when l does not own it.
func (s *Store) Release(ctx context.Context, l idempotency.Lease) error {
	return retriedErr(func() error {
		res, err := s.stmts.ExecContext(ctx, s.q.release, scopeHash(l.Scope), l.Owner, l.Generation)
		return changed("release", res, err)
	})
}

// SetRecoveryPoint implements idempotency.Store.SetRecoveryPoint outside any
// transaction. idempotency.ErrLeaseLost when l does not own an in-progress
// record.
func (s *Store) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string, data []byte, now time.Time) error {
	return retriedErr(func() error { return s.setPoint(ctx, s.stmts, l, point, data, now) })
}

// Abandoned implements idempotency.Store.Abandoned: up to limit in-progress
// records whose lease ended before now, the longest-expired first. A limit
// of 0 or less returns nothing.
func (s *Store) Abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	if limit <= 0 {
		return nil, nil
	}
	return retried(func() ([]idempotency.Record, error) { return s.abandoned(ctx, now, limit) })
}

func (s *Store) abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	rows, err := s.db.QueryContext(ctx, s.q.abandoned, nanos(now), int64(limit))
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

// DeleteBefore implements idempotency.Store.DeleteBefore with one bounded
// DELETE: up to limit records last updated before horizon that are completed
// or whose lease also ended before horizon, oldest first. On PostgreSQL it
// skips records that a concurrent write holds locked rather than wait for
// them (a later run finds them if they are still stale), and re-checks the
// conditions on each row it deletes, so a record taken over, heartbeated or
// completed meanwhile survives. A limit of 0 or less deletes nothing.
// Errors are *OpError with Op "delete_before".
func (s *Store) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	return retried(func() (int, error) {
		res, err := s.db.ExecContext(ctx, s.q.deleteBefore, nanos(horizon), int64(limit))
		if err != nil {
			return 0, opErr("delete_before", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return 0, opErr("delete_before", err)
		}
		return int(n), nil
	})
}

// execer is what the conditional writes need: *sql.DB or *sql.Tx.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

func (s *Store) heartbeat(ctx context.Context, ex execer, l idempotency.Lease, until time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.heartbeat, scopeHash(l.Scope), nanos(until), l.Owner, l.Generation)
	return changed("heartbeat", res, err)
}

func (s *Store) complete(ctx context.Context, ex execer, l idempotency.Lease, resp idempotency.Response, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.complete, scopeHash(l.Scope),
		int64(resp.Status), nullBytes(encodeHeader(resp.Header)), nullBytes(resp.Body), nanos(now), l.Owner, l.Generation)
	return changed("complete", res, err)
}

func (s *Store) setPoint(ctx context.Context, ex execer, l idempotency.Lease, point string, data []byte, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.setPoint, scopeHash(l.Scope),
		point, nullBytes(data), nanos(now), l.Owner, l.Generation)
	return changed("set_recovery_point", res, err)
}

// changed turns the result of a conditional write into nil, ErrLeaseLost (no
// row matched the fence) or an *OpError.
func changed(op string, res sql.Result, err error) error {
	if err != nil {
		return opErr(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return opErr(op, err)
	}
	if n == 0 {
		return idempotency.ErrLeaseLost
	}
	return nil
}

type scanner interface{ Scan(dest ...any) error }

// errScopeMismatch is the cause of the *OpError a read returns when the row
// found under a scope's digest holds other scope parts: a SHA-256 collision,
// or a row written by something other than this package.
var errScopeMismatch = errors.New("the stored record's scope differs from the one asked for (digest collision?)")

// scanScope scans a record read by sc's digest (and the extra columns that
// follow it into extra) and checks that it is sc's.
func scanScope(sc idempotency.Scope, row scanner, extra ...any) (idempotency.Record, error) {
	rec, err := scanRecord(row, extra...)
	if err == nil && rec.Scope != sc {
		return idempotency.Record{}, errScopeMismatch
	}
	return rec, err
}

// scopeHash returns the record's primary key: the SHA-256 of the scope's
// four parts (principal, method, route, key), each preceded by its length as
// an 8-byte big-endian integer, so that no two scopes share the input
// whatever bytes their parts hold. On PostgreSQL 11 or later the same value
// is sha256(int8send(octet_length(p1)) || p1 || ...) over the parts as bytea.
func scopeHash(sc idempotency.Scope) []byte {
	h := sha256.New()
	var n [8]byte
	for _, p := range [...]string{sc.Principal, sc.Method, sc.Route, sc.Key} {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		_, _ = io.WriteString(h, p)
	}
	return h.Sum(nil)
}

// scanRecord scans the columns of a record, then extra.
func scanRecord(sc scanner, extra ...any) (idempotency.Record, error) {
	var (
		r                                     idempotency.Record
		state, fpVersion                      int64
		leaseUntil, created, updated, complAt int64
		status                                sql.NullInt64
		principal, method, route, key         []byte
		header, recoveryData, request, body   []byte
	)
	err := sc.Scan(append([]any{&principal, &method, &route, &key, &state,
		&r.Fingerprint, &fpVersion, &r.Owner, &r.Generation, &leaseUntil, &r.RecoveryPoint,
		&recoveryData, &request, &status, &header, &body, &created, &updated, &complAt}, extra...)...)
	if err != nil {
		return idempotency.Record{}, err
	}
	r.Scope = idempotency.Scope{Principal: string(principal), Method: string(method), Route: string(route), Key: string(key)}
	r.State = idempotency.State(state)
	r.FingerprintVersion = int(fpVersion)
	r.LeaseUntil = fromNanos(leaseUntil)
	r.RecoveryData = recoveryData
	r.Request = request
	r.CreatedAt = fromNanos(created)
	r.UpdatedAt = fromNanos(updated)
	r.CompletedAt = fromNanos(complAt)
	if status.Valid {
		h, err := decodeHeader(header)
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

var (
	minTime = time.Unix(0, math.MinInt64+1)
	maxTime = time.Unix(0, math.MaxInt64)
)

// nanos converts t to Unix nanoseconds, 0 for the zero time, saturating
// outside the years 1678-2262 that int64 nanoseconds can hold.
func nanos(t time.Time) int64 {
	switch {
	case t.IsZero():
		return 0
	case t.Before(minTime):
		return math.MinInt64 + 1
	case t.After(maxTime):
		return math.MaxInt64
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}

// subSat returns n - d, saturating at the int64 bounds.
func subSat(n int64, d time.Duration) int64 {
	r := n - int64(d)
	if d > 0 && r > n {
		return math.MinInt64 + 1
	}
	if d < 0 && r < n {
		return math.MaxInt64
	}
	return r
}
