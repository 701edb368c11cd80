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
	"github.com/saferetry/saferetry/internal/unixnano"
)

// mysqlSchemaFmt is MySQL's table: the layout of schema, in MySQL's types.
// Every part of the scope, the fingerprint, the owner and the recovery
// point are LONGBLOB: bytes of any length, compared byte for byte (a TEXT
// column compares under its collation, which folds case and, on MariaDB,
// ignores trailing spaces: an owner token "A" would match "a "). BLOB
// columns take no DEFAULT in MySQL 8.0 before 8.0.13, so every INSERT names
// recovery_point. InnoDB, for the row locks and the transactions.
//
// MySQL has no partial index (and no CREATE INDEX IF NOT EXISTS: the
// indexes are clauses of the CREATE TABLE). The two indexes are SQLite's
// partial indexes' columns behind the state they select on, one
// for each background job: (state, lease_until) for the records in progress
// by lease end (the Completer's Abandoned, the Reaper's unfinished records)
// and (state, completed_at) for the completed records by completion time
// (the Reaper's deletes). Every record has an entry in both; nothing else is
// indexed, so a recovery point changes no index entry, a heartbeat one, and
// updated_at, which every write but a heartbeat changes, none. InnoDB has no
// per-table fill factor (innodb_fill_factor is the server's, for index
// builds only): an update that fits rewrites the row in place, and a body
// too large for the page is stored off it.
const mysqlSchemaFmt = `CREATE TABLE IF NOT EXISTS %[1]s (
	scope_hash          BINARY(32) NOT NULL PRIMARY KEY, -- SHA-256 of the scope parts
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
	INDEX %[1]s_pending_idx (state, lease_until),
	INDEX %[1]s_done_idx (state, completed_at)
) ENGINE = InnoDB`

func mysqlSchema(table string) string { return fmt.Sprintf(mysqlSchemaFmt, table) }

// mysqlQueries are the statements MySQL runs in place of PostgreSQL's and
// SQLite's claim statements and deleteBefore. Like every statement
// MySQL runs, they are written with $N placeholders in the order of the
// text and rebound to ? (see Dialect.rebind).
type mysqlQueries struct {
	// insert creates a fresh record, or fails with a duplicate key (1062)
	// when the scope's digest has a row: the first statement of a claim.
	insert string
	// locked reads the whole record FOR UPDATE, inside the transaction that
	// takes it over or restarts it with takeover or restart, each fenced on
	// the generation that locked read.
	locked, takeover, restart string
	// held checks, with a locking read, that a lease still holds its record
	// (see Store.fenced).
	held string
	// stale lists what DeleteBefore may delete; deleteBefore, completed
	// with as many placeholders as stale found, deletes those rows.
	stale, deleteBefore string
}

// buildMySQLQueries returns MySQL's own statements with their $N
// placeholders; buildQueries rebinds them.
func buildMySQLQueries(table string) mysqlQueries {
	m := mysqlQueries{
		insert: fmt.Sprintf(`INSERT INTO %s (scope_hash, principal, method, route, idem_key,
	state, fingerprint, fingerprint_version, owner, generation, lease_until, recovery_point,
	recovery_data, request, created_at, updated_at, completed_at)
VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8, 1, $9, '', NULL, $10, $11, $12, 0)`, table),

		locked: fmt.Sprintf(`SELECT %s FROM %s WHERE scope_hash = $1 FOR UPDATE`, columns, table),

		takeover: fmt.Sprintf(`UPDATE %s
SET owner = $1, generation = generation + 1, lease_until = $2, updated_at = $3
WHERE scope_hash = $4 AND generation = $5 AND state = 1`, table),

		restart: fmt.Sprintf(`UPDATE %s
SET state = 1, owner = $1, generation = generation + 1, lease_until = $2, fingerprint = $3,
	fingerprint_version = $4, recovery_point = '', recovery_data = NULL, request = $5,
	response_status = NULL, response_header = NULL, response_body = NULL,
	created_at = $6, updated_at = $7, completed_at = 0
WHERE scope_hash = $8 AND generation = $9 AND state = 2`, table),

		held: fmt.Sprintf(`SELECT 1 FROM %s
WHERE scope_hash = $1 AND owner = $2 AND generation = $3 AND state = 1 FOR UPDATE`, table),

		// MySQL refuses a LIMIT in an IN subquery and a subquery on the
		// DELETE's own table, and a DELETE bounded by its own ORDER BY and
		// LIMIT locks an index before the rows: against a unit, which locks
		// its row and then changes that index, it deadlocks (and under
		// REPEATABLE READ it locks the index's gaps, where live records
		// move to). So a plain read picks the rows, from the two indexes
		// as PostgreSQL's DELETE does, and the DELETE names them by primary
		// key, locking rows first as every other write does; it repeats the
		// conditions, which InnoDB checks on each row's latest version
		// under its lock, so a record taken over, heartbeated or completed
		// meanwhile survives.
		stale: fmt.Sprintf(`(SELECT scope_hash FROM %[1]s
	WHERE state = 2 AND completed_at < $1 AND updated_at < $2 ORDER BY completed_at LIMIT $3)
UNION ALL
(SELECT scope_hash FROM %[1]s
	WHERE state = 1 AND lease_until < $4 AND updated_at < $5 ORDER BY lease_until LIMIT $6)
LIMIT $7`, table),

		deleteBefore: fmt.Sprintf(`DELETE FROM %s
WHERE updated_at < $1 AND (state = 2 OR lease_until < $2) AND scope_hash IN (`, table),
	}
	return m
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
// driver, and go-sql-driver/mysql's *MySQLError has no method that gives
// the number (its Is compares with another *MySQLError only): this reads
// its Number field (uint16), by reflection, from an error whose type is a
// pointer to a struct named MySQLError, as in that driver and its forks.
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

// mysqlInsert is the first statement of a claim on MySQL, which has no
// RETURNING (MariaDB's INSERT has one, its UPDATE none) and no conditional
// upsert whose outcome a statement reports: ON DUPLICATE KEY UPDATE has no
// WHERE, and its per-column IF()s would depend on the order MySQL
// evaluates assignments in (left to right, unless MariaDB's
// SIMULTANEOUS_ASSIGNMENT mode is set). So the first statement is one
// INSERT, which creates the record (a fresh key costs this one statement)
// or fails on the duplicate key, returned as sql.ErrNoRows: Claim then
// reads the record with a plain read (a replay or an in-progress conflict:
// two statements, no row written), and only when it would win the record
// (an expired lease, or a completed record past the replay window) runs
// mysqlWin. A takeover-only claim never inserts: it starts at the read.
func (s *Store) mysqlInsert(ctx context.Context, q execer, c idempotency.Claim) (
	idempotency.ClaimResult, error) {
	if c.TakeoverOnly {
		return idempotency.ClaimResult{}, sql.ErrNoRows
	}
	now := unixnano.Of(c.Now)
	_, err := q.ExecContext(ctx, s.q.mysql.insert, scopeArgs(c.Scope, []byte(c.Fingerprint),
		int64(c.FingerprintVersion), []byte(c.Owner), unixnano.Of(c.Now.Add(c.LeaseFor)),
		nullBytes(c.Request), now, now)...)
	switch {
	case err == nil:
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated,
			Record: claimedRecord(c, 1)}, nil
	case mysqlErrorNumber(err) == mysqlDuplicateKey:
		return idempotency.ClaimResult{}, sql.ErrNoRows
	}
	return idempotency.ClaimResult{}, err
}

// mysqlWin takes over or restarts the record of c's scope in one
// transaction: it locks the row, decides on the version it locked
// (wouldWin) and writes with an UPDATE fenced on the locked generation, so
// concurrent claims never both win, and the outcome is the locked row's
// state. It answers ClaimExisting with the locked record when c no longer
// wins it, and sql.ErrNoRows when the row is gone.
func (s *Store) mysqlWin(ctx context.Context, c idempotency.Claim) (
	idempotency.ClaimResult, error) {
	m, hash := s.q.mysql, scopeHash(c.Scope)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	defer func() { _ = tx.Rollback() }()
	rec, err := scanScope(c.Scope, tx.QueryRowContext(ctx, m.locked, hash))
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	if !wouldWin(rec, c) { // another claim won it, or its owner completed or heartbeated it
		return idempotency.ClaimResult{Record: rec}, tx.Commit()
	}
	now, lease := unixnano.Of(c.Now), unixnano.Of(c.Now.Add(c.LeaseFor))
	var res sql.Result
	if rec.State == idempotency.Completed {
		res, err = tx.ExecContext(ctx, m.restart, []byte(c.Owner), lease, []byte(c.Fingerprint),
			int64(c.FingerprintVersion), nullBytes(c.Request), now, now, hash, rec.Generation)
	} else {
		res, err = tx.ExecContext(ctx, m.takeover, []byte(c.Owner), lease, now, hash,
			rec.Generation)
	}
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return idempotency.ClaimResult{}, errors.Join(err,
			fmt.Errorf("the locked record changed (%d rows updated)", n))
	}
	if err := tx.Commit(); err != nil {
		return idempotency.ClaimResult{}, err
	}
	r := claimedRecord(c, rec.Generation+1)
	if rec.State == idempotency.Completed {
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: r}, nil
	}
	r.RecoveryPoint, r.RecoveryData, r.Request = rec.RecoveryPoint, rec.RecoveryData, rec.Request
	r.CreatedAt = rec.CreatedAt
	return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: r}, nil
}

// mysqlDeleteBefore is DeleteBefore on MySQL: two statements, a plain read
// of up to limit stale rows' keys, completed records first, and a DELETE of
// those rows by primary key that checks the conditions again (see
// mysqlQueries.stale).
func (s *Store) mysqlDeleteBefore(ctx context.Context, horizon time.Time, limit int) (
	int, error) {
	h, n := unixnano.Of(horizon), int64(limit)
	keys, err := retried(func() ([]any, error) {
		rows, err := s.db.QueryContext(ctx, s.q.mysql.stale, h, h, n, h, h, n, n)
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
// The MySQL dialect has no earlier layout to upgrade.
func (s *Store) mysqlMigrate(ctx context.Context) error {
	_, err := s.db.ExecContext(ctx, mysqlSchema(s.table))
	return opErr("migrate", err)
}
