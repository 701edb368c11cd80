package sqlstore

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/unixnano"
)

// queries holds the statements of one Store, built once at Open by its
// dialect, in the dialect's placeholders. Each dialect fills the fields its
// code runs; the texts every dialect shares are sharedQueries'.
type queries struct {
	// get reads a whole record; existing reads the record a claim did not
	// create (existingCols).
	get, existing string
	// insert is the first statement of a claim (dialect.claim).
	insert string
	// insertWait is PostgreSQL's insert for a claim in one transaction
	// (dialect.claimInTx).
	insertWait string
	// takeover and restart are the writes of dialect.win.
	takeover, restart string
	// The fenced writes: each changes the record only while the lease
	// (owner and generation) holds it in progress.
	heartbeat, complete, release, setPoint string
	// The background jobs' statements.
	abandoned, deleteBefore string
	// MySQL's own: the locking read of its win, the check of a fence
	// that changed no row, the read of DeleteBefore's candidates, the
	// bound of a claim's lock wait in one transaction and its restore.
	locked, held, stale, setWait, resetWait string
}

// all returns every statement, by name.
func (q *queries) all() map[string]*string {
	return map[string]*string{"get": &q.get, "existing": &q.existing, "insert": &q.insert,
		"insert_wait": &q.insertWait, "takeover": &q.takeover, "restart": &q.restart,
		"heartbeat": &q.heartbeat, "complete": &q.complete, "release": &q.release,
		"set_point": &q.setPoint, "abandoned": &q.abandoned, "delete_before": &q.deleteBefore,
		"locked": &q.locked, "held": &q.held, "stale": &q.stale, "set_wait": &q.setWait,
		"reset_wait": &q.resetWait}
}

// rebind turns the $N placeholders of every statement into a dialect's.
func (q *queries) rebind(f func(string) string) {
	for _, p := range q.all() {
		*p = f(*p)
	}
}

// schema is the DDL of table on PostgreSQL and SQLite, whose type of bytes
// is blob (MySQL's is mysqlSchemaFmt). Every statement is idempotent (IF
// NOT EXISTS). The primary key is scope_hash, the SHA-256 of the
// length-prefixed scope parts (see scopeHash): 32 bytes whatever the parts
// hold, so that any bytes of any length work as a principal, method, route
// or key (PostgreSQL refuses invalid UTF-8 and NUL in TEXT, and B-tree index
// rows over 2704 bytes). The parts are kept as bytes beside it, and so is
// the recovery point. Times are integer nanoseconds since the Unix epoch,
// UTC, so that comparisons are exact in every dialect; 0 means "not set"
// (completed_at of an in-progress record).
//
// Two partial indexes serve the background jobs and nothing else: the
// records in progress by lease end (the Completer's Abandoned and the
// Reaper's unfinished records), and the completed records by completion
// time (the Reaper's DeleteBefore). A record is in one of them at a time,
// so a claim adds two index entries (the primary key's and the first
// index's) and a completion two (the primary key's and the second's); on
// PostgreSQL a completion, which changes the state the indexes select on,
// is a new row version, and the old one's entries are left to vacuum. A
// recovery point changes no indexed column (on PostgreSQL a HOT update when
// its page has room), and a heartbeat changes the first index's.
func schema(table, blob string) string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	scope_hash          %[2]s    NOT NULL PRIMARY KEY, -- SHA-256 of the length-prefixed scope parts
	principal           %[2]s    NOT NULL,
	method              %[2]s    NOT NULL,
	route               %[2]s    NOT NULL,
	idem_key            %[2]s    NOT NULL,
	state               SMALLINT NOT NULL CHECK (state IN (1, 2)), -- 1 in progress, 2 completed
	fingerprint         TEXT     NOT NULL,
	fingerprint_version INTEGER  NOT NULL,
	owner               TEXT     NOT NULL,
	generation          BIGINT   NOT NULL,
	lease_until         BIGINT   NOT NULL, -- Unix nanoseconds, UTC
	recovery_point      %[2]s    NOT NULL DEFAULT '',
	recovery_data       %[2]s,
	request             %[2]s,
	response_status     INTEGER,
	response_header     %[2]s,            -- length-prefixed names and values, byte for byte
	response_body       %[2]s,
	created_at          BIGINT   NOT NULL,
	updated_at          BIGINT   NOT NULL,
	completed_at        BIGINT   NOT NULL DEFAULT 0 -- 0 until completed
);
CREATE INDEX IF NOT EXISTS %[1]s_pending_idx ON %[1]s (lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS %[1]s_done_idx ON %[1]s (completed_at) WHERE state = 2;
`, table, blob)
}

// deleteBefore is the Reaper's DELETE on PostgreSQL and SQLite, each
// subquery's rows locked with lock ("" for none). Bounded: at most $2 rows
// per statement, chosen by primary key from the two partial indexes:
// completed records first, oldest completion first (for a completed record
// updated_at is completed_at), then records in progress whose lease and
// last update are both past the horizon. The conditions are repeated on
// the DELETE itself: on PostgreSQL under READ COMMITTED, a row that a
// concurrent claim, heartbeat or completion changed after the subquery saw
// it is re-checked against the DELETE's own WHERE only, so without them the
// reaper would delete a record that was just taken over or completed.
func deleteBefore(table, lock string) string {
	return fmt.Sprintf(`DELETE FROM %[1]s WHERE scope_hash IN (
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 2 AND completed_at < $1 AND updated_at < $1
		ORDER BY completed_at LIMIT $2%[2]s) done
	UNION ALL
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 1 AND lease_until < $1 AND updated_at < $1
		ORDER BY lease_until LIMIT $2%[2]s) unfinished
	LIMIT $2)
  AND updated_at < $1 AND (state = 2 OR lease_until < $1)`, table, lock)
}

// columns is the list every query that reads a whole record selects, in the
// order scanRecord expects.
const columns = `principal, method, route, idem_key, state, fingerprint, fingerprint_version,
	owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at`

// insertCols and insertVals are the columns and values of a new record:
// the parameters of insertArgs.
const (
	insertCols = `scope_hash, principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at`
	insertVals = `$1, $2, $3, $4, $5, 1, $6, $7, $8, 1, $9, '', NULL, $10,
	NULL, NULL, NULL, $11, $12, 0`
)

// sharedQueries returns the statements whose text every dialect shares,
// with $N placeholders, each named once and in the order of the text (as
// MySQL's ? needs).
func sharedQueries(table string) queries {
	return queries{
		get: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE scope_hash = $1`, table, columns),

		existing: fmt.Sprintf(`SELECT
	principal = $1 AND method = $2 AND route = $3 AND idem_key = $4, %[2]s
FROM %[1]s WHERE scope_hash = $5`, table, existingCols),

		heartbeat: fmt.Sprintf(`UPDATE %[1]s SET lease_until = $1
WHERE scope_hash = $2 AND owner = $3 AND generation = $4 AND state = 1`, table),

		complete: fmt.Sprintf(`UPDATE %[1]s
SET state = 2, response_status = $1, response_header = $2, response_body = $3,
	completed_at = $4, updated_at = $5
WHERE scope_hash = $6 AND owner = $7 AND generation = $8 AND state = 1`, table),

		release: fmt.Sprintf(`DELETE FROM %[1]s
WHERE scope_hash = $1 AND owner = $2 AND generation = $3 AND state = 1`, table),

		setPoint: fmt.Sprintf(`UPDATE %[1]s
SET recovery_point = $1, recovery_data = $2, updated_at = $3
WHERE scope_hash = $4 AND owner = $5 AND generation = $6 AND state = 1`, table),

		abandoned: fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE state = 1 AND lease_until < $1
ORDER BY lease_until, created_at, scope_hash
LIMIT $2`, table, columns),
	}
}

// existingCols are the columns of the record a claim did not create, after
// whether it holds the claim's scope parts: what a replay, a conflict and
// the claim's decision need (scanExisting), not the request or the
// recovery data.
const existingCols = `state, fingerprint, fingerprint_version, owner, generation, lease_until,
	completed_at, response_status, response_header, response_body`

// The win of PostgreSQL and SQLite is one conditional UPDATE by the
// scope's digest, with the parameters of claimArgs: $1 the digest, $2 to
// $5 the scope parts, $6 and $7 the fingerprint and its version, $8 the
// owner, $9 the lease end, $10 now, $11 the request, $12 the replay
// window's cutoff. It changes the row only if the row holds the claim's own
// scope parts (a digest collision never overwrites another scope's
// record), and then in one of two ways, each its own statement, so that
// the outcome is the statement's and never inferred from what the row
// holds afterwards: it takes over a record in progress whose lease ended
// before now with the same fingerprint and version (takeoverWhere), keeping
// its recovery point, its data, its request and created_at (takeoverSet,
// returning takenOver), or restarts a record that completed before the
// replay window's cutoff (restartWhere) as a fresh record with the next
// generation (restartSet, returning its generation). The takeover uses $1
// to $10 only.
const (
	takeoverSet   = `owner = $8, generation = generation + 1, lease_until = $9, updated_at = $10`
	takeoverWhere = `principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	AND state = 1 AND lease_until < $10 AND fingerprint = $6 AND fingerprint_version = $7`
	takenOver  = `generation, recovery_point, recovery_data, request, created_at`
	restartSet = `state = 1, owner = $8, generation = generation + 1, lease_until = $9,
	updated_at = $10, fingerprint = $6, fingerprint_version = $7, recovery_point = '',
	recovery_data = NULL, request = $11, created_at = $10,
	response_status = NULL, response_header = NULL, response_body = NULL, completed_at = 0`
	restartWhere = `principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	AND state = 2 AND completed_at < $12`
)

// conditionalWin returns the takeover and the restart of PostgreSQL and
// SQLite on table (see takeoverSet), with $N placeholders.
func conditionalWin(table string) (takeover, restart string) {
	takeover = fmt.Sprintf(`UPDATE %[1]s SET %[2]s
WHERE scope_hash = $1 AND %[3]s
RETURNING %[4]s`, table, takeoverSet, takeoverWhere, takenOver)
	restart = fmt.Sprintf(`UPDATE %[1]s SET %[2]s
WHERE scope_hash = $1 AND %[3]s
RETURNING generation`, table, restartSet, restartWhere)
	return takeover, restart
}

// returning is what PostgreSQL and SQLite do alike: their statements return
// the rows they write (RETURNING), and report the rows they matched.
type returning struct{}

// claim runs the INSERT that creates c's record or does nothing (ON
// CONFLICT DO NOTHING): it created the record when it inserted a row.
func (returning) claim(ctx context.Context, s *Store, q execer, c idempotency.Claim) (bool, error) {
	n, err := execRows(ctx, q, s.q.insert, s.insertArgs(c)...)
	return n == 1, err
}

// win runs the takeover or the restart, chosen by rec's state and checked
// by the statement's condition. sql.ErrNoRows when it matched no row.
func (returning) win(ctx context.Context, s *Store, q execer, c idempotency.Claim,
	rec idempotency.Record) (idempotency.ClaimResult, error) {
	args := claimArgs(c)
	if rec.State == idempotency.Completed {
		var gen int64
		if err := q.QueryRowContext(ctx, s.q.restart, args...).Scan(&gen); err != nil {
			return idempotency.ClaimResult{}, err
		}
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated,
			Record: claimedRecord(c, gen)}, nil
	}
	r := claimedRecord(c, 0)
	var (
		point   []byte
		created int64
	)
	err := q.QueryRowContext(ctx, s.q.takeover, args[:takeoverArgs]...).Scan(
		&r.Generation, &point, &r.RecoveryData, &r.Request, &created)
	if err != nil {
		return idempotency.ClaimResult{}, err
	}
	r.RecoveryPoint, r.CreatedAt = string(point), unixnano.Time(created)
	return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: r}, nil
}

// deleteBefore runs the dialect's one bounded DELETE (again after a
// serialization failure).
func (returning) deleteBefore(ctx context.Context, s *Store, horizon, limit int64) (int, error) {
	return retried(func() (int, error) {
		n, err := execRows(ctx, s.db, s.q.deleteBefore, horizon, limit)
		return int(n), err
	})
}

// execRows runs query on ex and returns how many rows it affected (as the
// driver counts them: MySQL's the rows it changed).
func execRows(ctx context.Context, ex interface {
	ExecContext(context.Context, string, ...any) (sql.Result, error)
}, query string, args ...any) (int64, error) {
	res, err := ex.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// confirmMiss: a write that matched no row found the lease lost.
func (returning) confirmMiss(context.Context, *Store, execer, idempotency.Lease) error {
	return idempotency.ErrLeaseLost
}

// text passes the string: SQLite never finds a BLOB equal to a TEXT.
func (returning) text(v string) any { return v }

// takeoverArgs is how many of claimArgs the takeover takes.
const takeoverArgs = 10
