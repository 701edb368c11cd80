package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// MySQL's table: the layout of schema, in MySQL's types. Every part of the
// scope, the fingerprint, the owner and the recovery point are LONGBLOB:
// bytes of any length, compared byte for byte (a TEXT column compares under
// its collation, which folds case and, on MariaDB, ignores trailing
// spaces: an owner token "A" would match "a "). The indexes are declared in
// the CREATE TABLE, since MySQL has no CREATE INDEX IF NOT EXISTS, and
// BLOB columns take no DEFAULT in MySQL 8.0 before 8.0.13, so every INSERT
// names recovery_point. InnoDB, for the row locks and the transactions.
const mysqlSchemaFmt = `CREATE TABLE IF NOT EXISTS %[1]s (
	scope_hash          BINARY(32) NOT NULL PRIMARY KEY, -- SHA-256 of the length-prefixed scope parts
	principal           LONGBLOB   NOT NULL,
	method              LONGBLOB   NOT NULL,
	route               LONGBLOB   NOT NULL,
	idem_key            LONGBLOB   NOT NULL,
	state               SMALLINT   NOT NULL CHECK (state IN (1, 2)), -- 1 in progress, 2 completed
	fingerprint         LONGBLOB   NOT NULL,
	fingerprint_version INTEGER    NOT NULL,
	owner               LONGBLOB   NOT NULL,
	generation          BIGINT     NOT NULL,
	lease_until         BIGINT     NOT NULL, -- Unix nanoseconds, UTC
	recovery_point      LONGBLOB   NOT NULL,
	recovery_data       LONGBLOB,
	request             LONGBLOB,
	response_status     INTEGER,
	response_header     LONGBLOB,            -- length-prefixed names and values, byte for byte
	response_body       LONGBLOB,
	created_at          BIGINT     NOT NULL,
	updated_at          BIGINT     NOT NULL,
	completed_at        BIGINT     NOT NULL DEFAULT 0, -- 0 until completed
	INDEX %[1]s_lease_idx (state, lease_until),
	INDEX %[1]s_updated_idx (updated_at)
) ENGINE = InnoDB`

func mysqlSchema(table string) string { return fmt.Sprintf(mysqlSchemaFmt, table) }

// mysqlQueries are the statements only the MySQL dialect runs. MySQL binds
// ? placeholders by position, so each statement's arguments are given in
// the order they appear in its text (the other dialects' $N statements are
// numbered otherwise).
type mysqlQueries struct {
	// insert creates a fresh record, or fails with a duplicate key (1062)
	// when the scope's digest has a row: the claim of every request.
	insert string
	// existing reads the record a claim did not create, to answer from:
	// what ClaimExisting needs, and the scope parts, compared in Go.
	existing string
	// locked reads the whole record FOR UPDATE, inside the transaction
	// that takes it over or restarts it.
	locked, takeover, restart string
	// The fenced writes, arguments in text order; held checks, with a
	// locking read, that a lease still owns its record when a write
	// changed no row (MySQL counts changed rows, not matched ones, so a
	// heartbeat to the lease end the record already has changes none).
	heartbeat, complete, setPoint, held string
	// stale lists what DeleteBefore may delete; deleteBefore (with as many
	// placeholders as stale found) deletes those rows.
	stale, deleteBefore string
}

func buildMySQLQueries(table string) queries {
	m := &mysqlQueries{
		insert: fmt.Sprintf(`INSERT INTO %s (scope_hash, principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	created_at, updated_at, completed_at)
VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, 1, ?, '', NULL, ?, ?, ?, 0)`, table),
		existing: fmt.Sprintf(`SELECT principal, method, route, idem_key, generation, state, fingerprint,
	fingerprint_version, owner, lease_until, completed_at, response_status, response_header, response_body
FROM %s WHERE scope_hash = ?`, table),
		locked: fmt.Sprintf(`SELECT %s FROM %s WHERE scope_hash = ? FOR UPDATE`, columns, table),
		takeover: fmt.Sprintf(`UPDATE %s SET owner = ?, generation = generation + 1, lease_until = ?, updated_at = ?
WHERE scope_hash = ? AND generation = ? AND state = 1`, table),
		restart: fmt.Sprintf(`UPDATE %s SET state = 1, owner = ?, generation = generation + 1, lease_until = ?,
	fingerprint = ?, fingerprint_version = ?, recovery_point = '', recovery_data = NULL, request = ?,
	response_status = NULL, response_header = NULL, response_body = NULL,
	created_at = ?, updated_at = ?, completed_at = 0
WHERE scope_hash = ? AND generation = ? AND state = 2`, table),
		heartbeat: fmt.Sprintf(`UPDATE %s SET lease_until = ?
WHERE scope_hash = ? AND owner = ? AND generation = ? AND state = 1`, table),
		complete: fmt.Sprintf(`UPDATE %s SET state = 2, response_status = ?, response_header = ?,
	response_body = ?, completed_at = ?, updated_at = ?
WHERE scope_hash = ? AND owner = ? AND generation = ? AND state = 1`, table),
		setPoint: fmt.Sprintf(`UPDATE %s SET recovery_point = ?, recovery_data = ?, updated_at = ?
WHERE scope_hash = ? AND owner = ? AND generation = ? AND state = 1`, table),
		held: fmt.Sprintf(`SELECT 1 FROM %s
WHERE scope_hash = ? AND owner = ? AND generation = ? AND state = 1 FOR UPDATE`, table),
		// MySQL refuses a LIMIT in an IN subquery and a subquery on the
		// DELETE's own table, and a DELETE bounded by its own ORDER BY and
		// LIMIT would lock the updated_at index before the rows: against
		// a unit, which locks its row and then changes that index, it
		// deadlocks (and under REPEATABLE READ it locks the index's gaps,
		// where live records move to). So a plain read picks the rows and
		// the DELETE names them by primary key, locking rows first as every
		// other write does; it repeats the conditions, which InnoDB checks
		// on each row's latest version under its lock, so a record taken
		// over, heartbeated or completed meanwhile survives.
		stale: fmt.Sprintf(`SELECT scope_hash FROM %s
WHERE updated_at < ? AND (state = 2 OR lease_until < ?)
ORDER BY updated_at
LIMIT ?`, table),
		deleteBefore: fmt.Sprintf(`DELETE FROM %s
WHERE updated_at < ? AND (state = 2 OR lease_until < ?) AND scope_hash IN (`, table),
	}
	return queries{
		get:     fmt.Sprintf(`SELECT %s FROM %s WHERE scope_hash = ?`, columns, table),
		release: fmt.Sprintf(`DELETE FROM %s WHERE scope_hash = ? AND owner = ? AND generation = ? AND state = 1`, table),
		abandoned: fmt.Sprintf(`SELECT %s FROM %s
WHERE state = 1 AND lease_until < ?
ORDER BY lease_until, created_at, scope_hash
LIMIT ?`, columns, table),
		mysql: m,
	}
}

// identifyMySQL asks db for @@version, which only MySQL and MariaDB answer
// (MariaDB's reads like "10.11.6-MariaDB-0+deb12u1"), and returns the
// server's name and version, such as "MariaDB 10.11.6" or "MySQL 8.0.36".
func identifyMySQL(ctx context.Context, db *sql.DB) (Dialect, string, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT @@version").Scan(&v); err != nil {
		return 0, "", err
	}
	num, _, _ := strings.Cut(v, "-")
	if strings.Contains(v, "MariaDB") {
		return MySQL, "MariaDB " + num, nil
	}
	return MySQL, "MySQL " + num, nil
}

// MySQL server error numbers the Store acts on. After a lock wait timeout
// the statement rolled back (the transaction too with
// innodb_rollback_on_timeout); after a deadlock the transaction did.
const (
	mysqlDuplicateKey    = 1062 // ER_DUP_ENTRY
	mysqlLockWaitTimeout = 1205 // ER_LOCK_WAIT_TIMEOUT
	mysqlDeadlock        = 1213 // ER_LOCK_DEADLOCK
)

// mysqlErrorNumber returns the server error number of the first MySQL
// error in err's chain, 0 when there is none. The package imports no
// driver: it reads the Number field (uint16) of a *MySQLError, the type of
// github.com/go-sql-driver/mysql and of its forks.
func mysqlErrorNumber(err error) uint16 {
	for err != nil {
		if v := reflect.ValueOf(err); v.Kind() == reflect.Pointer && !v.IsNil() {
			if e := v.Elem(); e.Kind() == reflect.Struct && e.Type().Name() == "MySQLError" {
				if f := e.FieldByName("Number"); f.Kind() == reflect.Uint16 {
					return uint16(f.Uint())
				}
			}
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if n := mysqlErrorNumber(e); n != 0 {
					return n
				}
			}
			return 0
		default:
			return 0
		}
	}
	return 0
}

// isMySQLRetryable reports whether err is an InnoDB deadlock (1213) or lock
// wait timeout (1205): nothing of the statement committed, and running it
// again is safe.
func isMySQLRetryable(err error) bool {
	n := mysqlErrorNumber(err)
	return n == mysqlDeadlock || n == mysqlLockWaitTimeout
}

// mysqlClaim is Claim on MySQL, which has no RETURNING (MariaDB's INSERT
// has one, its UPDATE none) and no conditional upsert whose outcome a
// statement reports: ON DUPLICATE KEY UPDATE has no WHERE, and its
// per-column IF()s would depend on the order MySQL evaluates assignments in
// (left to right, unless MariaDB's SIMULTANEOUS_ASSIGNMENT mode is set).
// So a claim is:
//
//   - one INSERT, which creates the record or fails on the duplicate key:
//     a fresh key costs this one statement;
//   - when the key has a record, one plain read of it to answer from (a
//     replay or an in-progress conflict: two statements, no row written);
//   - only when that read shows a record the claim would win (an expired
//     lease, or a completed record past the replay window), a transaction
//     that reads it again FOR UPDATE, decides on what it locked and takes
//     it over or restarts it with an UPDATE fenced on the generation.
//
// Each decision is one atomic step on the row (the INSERT's unique key, or
// the row lock), so concurrent claims never both win. A deadlock or lock
// wait timeout of a step is run again (retried). The loop repeats only when
// the record that beat the INSERT vanished (released or reaped) before it
// was read.
func (s *Store) mysqlClaim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	m := s.q.mysql
	hash := scopeHash(c.Scope)
	for range 3 {
		if !c.TakeoverOnly {
			err := retriedErr(func() error {
				_, err := s.stmts.ExecContext(ctx, m.insert, scopeArgs(c.Scope,
					[]byte(c.Fingerprint), int64(c.FingerprintVersion), []byte(c.Owner),
					nanos(c.Now.Add(c.LeaseFor)), nullBytes(c.Request), nanos(c.Now), nanos(c.Now))...)
				return err
			})
			if err == nil {
				return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: wonRecord(c, 1)}, nil
			}
			if mysqlErrorNumber(err) != mysqlDuplicateKey {
				return idempotency.ClaimResult{}, opErr("claim", err)
			}
		}
		res, err := retried(func() (idempotency.ClaimResult, error) {
			return scanMySQLExisting(s.stmts.QueryRowContext(ctx, m.existing, hash), c)
		})
		if err == nil && mysqlWins(res.Record, c) {
			res, err = retried(func() (idempotency.ClaimResult, error) { return s.mysqlTakeOver(ctx, c, hash) })
		}
		if err == nil {
			return res, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return idempotency.ClaimResult{}, opErr("claim", err)
		}
		if c.TakeoverOnly {
			return idempotency.ClaimResult{}, nil // nothing to take over
		}
	}
	return idempotency.ClaimResult{}, opErr("claim", errors.New("record kept vanishing between claim and read"))
}

// mysqlWins reports whether c wins rec: wouldWin, except that a
// takeover-only claim never restarts a completed record.
func mysqlWins(rec idempotency.Record, c idempotency.Claim) bool {
	if c.TakeoverOnly && rec.State != idempotency.InProgress {
		return false
	}
	return wouldWin(rec, c)
}

// mysqlTakeOver takes over or restarts the record of c's scope in one
// transaction: it locks the row, decides on the version it locked, and
// writes. sql.ErrNoRows when the row is gone.
func (s *Store) mysqlTakeOver(ctx context.Context, c idempotency.Claim, hash []byte) (idempotency.ClaimResult, error) {
	m := s.q.mysql
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	defer func() { _ = tx.Rollback() }()
	rec, err := scanScope(c.Scope, tx.QueryRowContext(ctx, m.locked, hash))
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	if !mysqlWins(rec, c) { // another claim won it, or its owner completed or heartbeated it
		return idempotency.ClaimResult{Record: rec}, tx.Commit()
	}
	now, lease := nanos(c.Now), nanos(c.Now.Add(c.LeaseFor))
	var res sql.Result
	if rec.State == idempotency.Completed {
		res, err = tx.ExecContext(ctx, m.restart, []byte(c.Owner), lease, []byte(c.Fingerprint),
			int64(c.FingerprintVersion), nullBytes(c.Request), now, now, hash, rec.Generation)
	} else {
		res, err = tx.ExecContext(ctx, m.takeover, []byte(c.Owner), lease, now, hash, rec.Generation)
	}
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return idempotency.ClaimResult{}, errors.Join(err, fmt.Errorf("the locked record changed (%d rows updated)", n))
	}
	if err := tx.Commit(); err != nil {
		return idempotency.ClaimResult{}, err
	}
	r := wonRecord(c, rec.Generation+1)
	if rec.State == idempotency.Completed {
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: r}, nil
	}
	r.RecoveryPoint, r.RecoveryData, r.Request, r.CreatedAt = rec.RecoveryPoint, rec.RecoveryData, rec.Request, rec.CreatedAt
	return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: r}, nil
}

// wonRecord is the record a claim c created with generation gen: the
// claim's own values.
func wonRecord(c idempotency.Claim, gen int64) idempotency.Record {
	now := fromNanos(nanos(c.Now))
	return idempotency.Record{
		Scope: c.Scope, State: idempotency.InProgress, Fingerprint: c.Fingerprint,
		FingerprintVersion: c.FingerprintVersion, Owner: c.Owner, Generation: gen,
		LeaseUntil: fromNanos(nanos(c.Now.Add(c.LeaseFor))), CreatedAt: now, UpdatedAt: now,
		Request: c.Request,
	}
}

// scanMySQLExisting reads the row of mysqlQueries.existing into the
// ClaimExisting result for c; errScopeMismatch when the row holds another
// scope.
func scanMySQLExisting(row scanner, c idempotency.Claim) (idempotency.ClaimResult, error) {
	var (
		principal, method, route, key, header, body []byte
		generation, state, fpVersion, lease, compl  int64
		fingerprint, owner                          string
		status                                      sql.NullInt64
	)
	if err := row.Scan(&principal, &method, &route, &key, &generation, &state, &fingerprint, &fpVersion,
		&owner, &lease, &compl, &status, &header, &body); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if string(principal) != c.Scope.Principal || string(method) != c.Scope.Method ||
		string(route) != c.Scope.Route || string(key) != c.Scope.Key {
		return idempotency.ClaimResult{}, errScopeMismatch
	}
	r := idempotency.Record{
		Scope: c.Scope, State: idempotency.State(state), Fingerprint: fingerprint,
		FingerprintVersion: int(fpVersion), Owner: owner, Generation: generation,
		LeaseUntil: fromNanos(lease), CompletedAt: fromNanos(compl),
	}
	if status.Valid {
		h, err := decodeHeader(header)
		if err != nil {
			return idempotency.ClaimResult{}, err
		}
		r.Response = &idempotency.Response{Status: int(status.Int64), Header: h, Body: body}
	}
	return idempotency.ClaimResult{Record: r}, nil
}

// mysqlFenced turns the result of a fenced write that may change no column
// (a heartbeat or a recovery point equal to what the record holds) into
// nil, ErrLeaseLost or an *OpError: when no row changed, a locking read on
// ex (a current read, even in a REPEATABLE READ transaction whose snapshot
// is older) tells whether l still owns the record.
func (s *Store) mysqlFenced(ctx context.Context, ex execer, op string, l idempotency.Lease, res sql.Result, err error) error {
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
	q, ok := ex.(rowQueryer)
	if !ok {
		return idempotency.ErrLeaseLost
	}
	var one int
	err = q.QueryRowContext(ctx, s.q.mysql.held, scopeHash(l.Scope), []byte(l.Owner), l.Generation).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return idempotency.ErrLeaseLost
	}
	return opErr(op, err)
}

func (s *Store) mysqlHeartbeat(ctx context.Context, ex execer, l idempotency.Lease, until time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.mysql.heartbeat, nanos(until), scopeHash(l.Scope), []byte(l.Owner), l.Generation)
	return s.mysqlFenced(ctx, ex, "heartbeat", l, res, err)
}

func (s *Store) mysqlComplete(ctx context.Context, ex execer, l idempotency.Lease, resp idempotency.Response, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.mysql.complete, int64(resp.Status), nullBytes(encodeHeader(resp.Header)),
		nullBytes(resp.Body), nanos(now), nanos(now), scopeHash(l.Scope), []byte(l.Owner), l.Generation)
	return changed("complete", res, err) // a completion always changes state
}

func (s *Store) mysqlSetPoint(ctx context.Context, ex execer, l idempotency.Lease, point string, data []byte, now time.Time) error {
	res, err := ex.ExecContext(ctx, s.q.mysql.setPoint, []byte(point), nullBytes(data), nanos(now),
		scopeHash(l.Scope), []byte(l.Owner), l.Generation)
	return s.mysqlFenced(ctx, ex, "set_recovery_point", l, res, err)
}

// mysqlDeleteBefore is DeleteBefore on MySQL: two statements, a plain read
// of up to limit stale rows' keys, oldest first, and a DELETE of those rows
// by primary key that checks the conditions again (see
// mysqlQueries.deleteBefore).
func (s *Store) mysqlDeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	h := nanos(horizon)
	keys, err := retried(func() ([]any, error) {
		rows, err := s.db.QueryContext(ctx, s.q.mysql.stale, h, h, int64(limit))
		if err != nil {
			return nil, err
		}
		defer func() { _ = rows.Close() }()
		var keys []any
		for rows.Next() {
			var k []byte
			if err := rows.Scan(&k); err != nil {
				return nil, err
			}
			keys = append(keys, k)
		}
		return keys, rows.Err()
	})
	if err != nil || len(keys) == 0 {
		return 0, opErr("delete_before", err)
	}
	q := s.q.mysql.deleteBefore + strings.Repeat("?, ", len(keys)-1) + "?)"
	args := append([]any{h, h}, keys...)
	return retried(func() (int, error) {
		res, err := s.db.ExecContext(ctx, q, args...)
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

// mysqlMigrate runs the schema's one CREATE TABLE IF NOT EXISTS, outside a
// transaction (MySQL commits DDL at once); a second run changes nothing.
// There is no earlier MySQL layout to upgrade.
func (s *Store) mysqlMigrate(ctx context.Context) error {
	_, err := s.db.ExecContext(ctx, mysqlSchema(s.table))
	return opErr("migrate", err)
}
