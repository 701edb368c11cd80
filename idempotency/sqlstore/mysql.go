package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"regexp"
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

// mysqlDialect is MySQL's and MariaDB's: its SQL and its claim, win and
// DeleteBefore, which take more statements than PostgreSQL's and SQLite's
// (MySQL has no RETURNING, and reports the rows an UPDATE changed, not
// those it matched).
type mysqlDialect struct{}

func (mysqlDialect) name() string { return "mysql" }

// identify asks db for @@version, which only MySQL and MariaDB answer
// (MariaDB's reads like "10.11.6-MariaDB-0+deb12u1"), and returns the
// server's name and version, such as "MariaDB 10.11.6" or "MySQL 8.0.36".
func (mysqlDialect) identify(ctx context.Context, db *sql.DB) (bool, string, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT @@version").Scan(&v); err != nil {
		return false, "", err
	}
	num, _, _ := strings.Cut(v, "-")
	if strings.Contains(v, "MariaDB") {
		return true, "MariaDB " + num, nil
	}
	return true, "MySQL " + num, nil
}

func (mysqlDialect) check(context.Context, *sql.DB) error { return nil }

// prepared is true: a prepared statement runs in one round trip whatever
// the DSN (an unprepared one with arguments takes two unless
// interpolateParams is set).
func (mysqlDialect) prepared() bool { return true }

// txOptions are nil: MySQL's fences are locking reads and conditional
// writes, which InnoDB runs on the latest row version at every level, so a
// unit keeps the session's level, which the application chose.
func (mysqlDialect) txOptions() *sql.TxOptions { return nil }

func (mysqlDialect) schema(table string) string { return fmt.Sprintf(mysqlSchemaFmt, table) }

// text passes bytes: the columns are LONGBLOBs, compared byte for byte.
func (mysqlDialect) text(v string) any { return []byte(v) }

// placeholder is a $N placeholder.
var placeholder = regexp.MustCompile(`\$[0-9]+`)

// rebind turns $N into a bare ?, which binds by position: every statement
// MySQL runs names its placeholders in the order of the text, each once
// (the internal test TestMySQLPlaceholdersAreInTextOrder checks them).
func (mysqlDialect) rebind(q string) string { return placeholder.ReplaceAllString(q, "?") }

// queries are the shared statements and MySQL's own (mysqlStatements),
// rebound to ?.
func (d mysqlDialect) queries(table string) queries {
	q := mysqlStatements(table)
	q.rebind(d.rebind)
	return q
}

// mysqlStatements are the statements of a MySQL Store, with $N
// placeholders.
func mysqlStatements(table string) queries {
	q := sharedQueries(table)

	// The first statement of a claim: it creates a fresh record, or fails
	// with a duplicate key (1062) when the scope's digest has a row.
	q.insert = fmt.Sprintf(`INSERT INTO %s (%s) VALUES (%s)`, table, insertCols, insertVals)

	// locked reads the whole record FOR UPDATE, inside the transaction
	// that takes it over or restarts it with takeover or restart, each
	// fenced on the generation that locked read.
	q.locked = fmt.Sprintf(`SELECT %s FROM %s WHERE scope_hash = $1 FOR UPDATE`, columns, table)
	q.takeover = fmt.Sprintf(`UPDATE %s
SET owner = $1, generation = generation + 1, lease_until = $2, updated_at = $3
WHERE scope_hash = $4 AND generation = $5 AND state = 1`, table)
	q.restart = fmt.Sprintf(`UPDATE %s
SET state = 1, owner = $1, generation = generation + 1, lease_until = $2, fingerprint = $3,
	fingerprint_version = $4, recovery_point = '', recovery_data = NULL, request = $5,
	response_status = NULL, response_header = NULL, response_body = NULL,
	created_at = $6, updated_at = $7, completed_at = 0
WHERE scope_hash = $8 AND generation = $9 AND state = 2`, table)

	// setWait and resetWait bound the lock wait of a claim in one
	// transaction (innodb_lock_wait_timeout, whole seconds) and restore
	// the session's value for the handler's statements.
	q.setWait = `SET @saferetry_lock_wait = @@SESSION.innodb_lock_wait_timeout,
	SESSION innodb_lock_wait_timeout = $1`
	q.resetWait = `SET SESSION innodb_lock_wait_timeout = @saferetry_lock_wait`

	// held checks, with a locking read, that a lease still holds its
	// record (see confirmMiss).
	q.held = fmt.Sprintf(`SELECT 1 FROM %s
WHERE scope_hash = $1 AND owner = $2 AND generation = $3 AND state = 1 FOR UPDATE`, table)

	// MySQL refuses a LIMIT in an IN subquery and a subquery on the
	// DELETE's own table, and a DELETE bounded by its own ORDER BY and
	// LIMIT locks an index before the rows: against a unit, which locks
	// its row and then changes that index, it deadlocks (and under
	// REPEATABLE READ it locks the index's gaps, where live records move
	// to). So a plain read (stale) picks the rows, from the two indexes as
	// PostgreSQL's DELETE does, and the DELETE names them by primary key,
	// locking rows first as every other write does; it repeats the
	// conditions, which InnoDB checks on each row's latest version under
	// its lock, so a record taken over, heartbeated or completed meanwhile
	// survives. deleteBefore is completed with as many placeholders as
	// stale found keys.
	q.stale = fmt.Sprintf(`(SELECT scope_hash FROM %[1]s
	WHERE state = 2 AND completed_at < $1 AND updated_at < $2 ORDER BY completed_at LIMIT $3)
UNION ALL
(SELECT scope_hash FROM %[1]s
	WHERE state = 1 AND lease_until < $4 AND updated_at < $5 ORDER BY lease_until LIMIT $6)
LIMIT $7`, table)
	q.deleteBefore = fmt.Sprintf(`DELETE FROM %s
WHERE updated_at < $1 AND (state = 2 OR lease_until < $2) AND scope_hash IN (`, table)
	return q
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

// claim is the first statement of a claim on MySQL, which has no RETURNING
// (MariaDB's INSERT has one, its UPDATE none) and no conditional upsert
// whose outcome a statement reports: ON DUPLICATE KEY UPDATE has no WHERE,
// and its per-column IF()s would depend on the order MySQL evaluates
// assignments in (left to right, unless MariaDB's SIMULTANEOUS_ASSIGNMENT
// mode is set). So it is one INSERT, which creates the record or fails on
// the duplicate key, which is no error here: the claim then reads the
// record (a replay or an in-progress conflict: two statements, no row
// written), and only when it would win the record (an expired lease, or a
// completed record past the replay window) runs win.
func (mysqlDialect) claim(ctx context.Context, s *Store, q execer, c idempotency.Claim) (
	bool, error) {
	_, err := q.ExecContext(ctx, s.q.insert, s.insertArgs(c)...)
	if mysqlErrorNumber(err) == mysqlDuplicateKey {
		return false, nil
	}
	return err == nil, err
}

// claimInTx bounds the session's innodb_lock_wait_timeout by wait
// (at least minClaimWait, rounded up to whole seconds: MySQL's unit),
// runs the claim's INSERT, which waits for a row of the key that another
// transaction inserted and has not committed, and restores the session's
// value: three statements. When the restore fails (its context canceled
// after the SET, say), the error matches errSessionChanged.
func (d mysqlDialect) claimInTx(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim,
	wait time.Duration) (bool, error) {
	secs := min(int64((max(wait, minClaimWait)+time.Second-1)/time.Second), 1<<30)
	if _, err := tx.ExecContext(ctx, s.q.setWait, secs); err != nil {
		// Whether the SET applied is unknown: the session may keep it.
		return false, fmt.Errorf("%w: %w", errSessionChanged, err)
	}
	created, err := d.claim(ctx, s, tx, c)
	if _, rerr := tx.ExecContext(ctx, s.q.resetWait); rerr != nil {
		return false, fmt.Errorf("%w: %w", errSessionChanged, errors.Join(err, rerr))
	}
	return created, err
}

// heldPastWait: a lock wait timeout (1205).
func (mysqlDialect) heldPastWait(err error) bool {
	return mysqlErrorNumber(err) == mysqlLockWaitTimeout
}

// win takes over or restarts the record of c's scope in one transaction of
// its own (never on q):
// it locks the row, decides on the version it locked (wouldWin) and writes
// with an UPDATE fenced on the locked generation, so concurrent claims
// never both win, and the outcome is the locked row's state. It answers
// ClaimExisting with the locked record when c no longer wins it, and
// sql.ErrNoRows when the row is gone.
func (mysqlDialect) win(ctx context.Context, s *Store, _ execer, c idempotency.Claim,
	_ idempotency.Record) (idempotency.ClaimResult, error) {
	hash := scopeHash(c.Scope)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	defer func() { _ = tx.Rollback() }()
	rec, err := scanScope(c.Scope, tx.QueryRowContext(ctx, s.q.locked, hash))
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	if !wouldWin(rec, c) { // another claim won it, or its owner completed or heartbeated it
		return idempotency.ClaimResult{Record: rec}, tx.Commit()
	}
	now, lease := unixnano.Of(c.Now), unixnano.Add(c.Now, c.LeaseFor)
	var res sql.Result
	if rec.State == idempotency.Completed {
		res, err = tx.ExecContext(ctx, s.q.restart, []byte(c.Owner), lease, []byte(c.Fingerprint),
			int64(c.FingerprintVersion), nullBytes(c.Request), now, now, hash, rec.Generation)
	} else {
		res, err = tx.ExecContext(ctx, s.q.takeover, []byte(c.Owner), lease, now, hash,
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

// deleteBefore is two statements, each run again after a deadlock: a plain
// read of up to limit stale rows' keys, completed records first, and a
// DELETE of those rows by primary key that checks the conditions again (see
// queries, stale).
func (mysqlDialect) deleteBefore(ctx context.Context, s *Store, h, n int64) (int, error) {
	keys, err := retried(func() ([]any, error) {
		rows, err := s.db.QueryContext(ctx, s.q.stale, h, h, n, h, h, n, n)
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
		return 0, err
	}
	q := s.q.deleteBefore + strings.Repeat("?, ", len(keys)-1) + "?)"
	args := append([]any{h, h}, keys...)
	return retried(func() (int, error) {
		n, err := execRows(ctx, s.db, q, args...)
		return int(n), err
	})
}

// confirmMiss runs a locking read on ex (a current read, even in a
// REPEATABLE READ transaction whose snapshot is older) that tells whether l
// still holds the record: MySQL reports the rows a write changed, not those
// it matched (unless the DSN sets clientFoundRows), and a heartbeat or
// recovery point equal to what the record holds changes none.
func (mysqlDialect) confirmMiss(ctx context.Context, s *Store, ex execer,
	l idempotency.Lease) error {
	var one int
	err := ex.QueryRowContext(ctx, s.q.held, scopeHash(l.Scope), []byte(l.Owner),
		l.Generation).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return idempotency.ErrLeaseLost
	}
	return err
}

// migrate runs the schema's one CREATE TABLE IF NOT EXISTS, outside a
// transaction (MySQL commits DDL at once); a second run changes nothing.
// The MySQL dialect has no earlier layout to upgrade.
func (d mysqlDialect) migrate(ctx context.Context, s *Store) error {
	_, err := s.db.ExecContext(ctx, d.schema(s.table))
	return err
}
