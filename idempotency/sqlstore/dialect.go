package sqlstore

import (
	"fmt"
	"regexp"
	"strings"
)

// Dialect selects the SQL flavour the Store speaks. The zero value is not a
// valid dialect: use Postgres or SQLite.
type Dialect int

const (
	// Postgres is PostgreSQL 9.5 or later (ON CONFLICT ... RETURNING), for a
	// fleet of servers sharing one store. Tested with the
	// github.com/jackc/pgx/v5/stdlib driver (driver name "pgx").
	Postgres Dialect = iota + 1
	// SQLite is SQLite 3.35 or later (UPSERT with RETURNING), the embedded
	// store for one process. Tested with the pure-Go modernc.org/sqlite
	// driver (driver name "sqlite"); open it with the DSN from SQLiteDSN.
	SQLite
)

// String returns "postgres", "sqlite" or "Dialect(n)" for an invalid value.
func (d Dialect) String() string {
	switch d {
	case Postgres:
		return "postgres"
	case SQLite:
		return "sqlite"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

func (d Dialect) valid() bool { return d == Postgres || d == SQLite }

// blobType is the column type for opaque bytes.
func (d Dialect) blobType() string {
	if d == Postgres {
		return "BYTEA"
	}
	return "BLOB"
}

// skipLocked is the locking clause of the reaper's subquery: PostgreSQL
// locks the rows it picks and skips those another transaction holds; SQLite
// has no row locks (and no FOR UPDATE).
func (d Dialect) skipLocked() string {
	if d == Postgres {
		return "\n\tFOR UPDATE SKIP LOCKED"
	}
	return ""
}

// rebind turns the $N placeholders the queries are written with into the
// dialect's own: PostgreSQL keeps $N, SQLite gets its numbered ?N form.
func (d Dialect) rebind(q string) string {
	if d == Postgres {
		return q
	}
	return strings.ReplaceAll(q, "$", "?")
}

// DefaultTable is the table name used when WithTable is not given.
const DefaultTable = "idempotency_records"

// maxTableLen keeps the derived index names ("<table>_lease_idx") within
// PostgreSQL's 63-byte identifier limit.
const maxTableLen = 48

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// validTable reports whether name is an unquoted SQL identifier that both
// dialects accept as it is: ASCII letters, digits and underscores, not
// starting with a digit, 1 to 48 characters.
func validTable(name string) bool {
	return len(name) > 0 && len(name) <= maxTableLen && identRE.MatchString(name)
}

// columns is the list every query that reads a whole record selects, in the
// order scanRecord expects.
const columns = `principal, method, route, idem_key, state, fingerprint, fingerprint_version,
	owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at`

// schema returns the DDL for table in dialect d. Every statement is
// idempotent (IF NOT EXISTS). The primary key is scope_hash, the SHA-256 of
// the length-prefixed scope parts (see scopeHash): 32 bytes whatever the
// parts hold, so that any bytes of any length work as a principal, method,
// route or key (PostgreSQL refuses invalid UTF-8 and NUL in TEXT, and B-tree
// index rows over 2704 bytes). The parts are kept as bytes beside it. Times
// are INTEGER/BIGINT nanoseconds since the Unix epoch, UTC, so that
// comparisons are exact in both dialects; 0 means "not set" (completed_at of
// an in-progress record).
func schema(d Dialect, table string) string {
	blob := d.blobType()
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
	recovery_point      TEXT     NOT NULL DEFAULT '',
	recovery_data       %[2]s,
	request             %[2]s,
	response_status     INTEGER,
	response_header     %[2]s,            -- length-prefixed names and values, byte for byte
	response_body       %[2]s,
	created_at          BIGINT   NOT NULL,
	updated_at          BIGINT   NOT NULL,
	completed_at        BIGINT   NOT NULL DEFAULT 0 -- 0 until completed
);
CREATE INDEX IF NOT EXISTS %[1]s_lease_idx ON %[1]s (state, lease_until);
CREATE INDEX IF NOT EXISTS %[1]s_updated_idx ON %[1]s (updated_at);
`, table, blob)
}

// queries holds the statements of one Store, built once at Open.
type queries struct {
	claim, takeover, get, heartbeat, complete, release, setPoint, abandoned, deleteBefore string
}

// claimWins is the condition under which a claim wins an existing row t
// against the candidate row excluded: a completed record that fell out of
// the replay window ($12, the cutoff) starts over, and an in-progress record
// whose lease expired before now ($11) with the same fingerprint (and
// fingerprint version) is taken over.
const claimWins = `((t.state = 2 AND t.completed_at < $12)
	OR (t.state = 1 AND t.lease_until < $11 AND t.fingerprint = excluded.fingerprint
	    AND t.fingerprint_version = excluded.fingerprint_version))`

// claimSQL returns the claim statement: one statement that both decides the
// claim and returns the row to answer from, whoever won.
//
// PostgreSQL: the INSERT ... ON CONFLICT DO UPDATE ... WHERE claimWins runs
// in a CTE; its RETURNING row (a new record, a restart or a takeover) is the
// answer, and when it returns nothing the outer SELECT returns the existing
// row, read FOR SHARE: under READ COMMITTED a locking read returns the
// row's latest committed version, not the one the statement's snapshot saw
// (a claim that waited behind another transaction's completion, release or
// takeover answers what that transaction left), and it never waits, since
// ON CONFLICT already holds the row's lock (under REPEATABLE READ a changed
// row raises a serialization failure, which Claim retries). The one case
// where it returns nothing is a conflicting row inserted by a transaction
// that committed after the statement began (ON CONFLICT waits for it and
// sees it; the snapshot does not): the statement then returns no row, and
// Claim reads the record once more.
//
// SQLite has no data-modifying CTEs, and its RETURNING returns only rows
// the statement wrote, so DO UPDATE always writes the row: every column is
// set to CASE WHEN claimWins THEN <the claim's value> ELSE <its own value>
// END, and RETURNING gives the row either way. The statement holds the
// database's write lock anyway (it may insert), so the rewrite of an
// unchanged row costs no extra round trip or lock; it does write the row's
// page to the WAL again, which a checkpoint folds back.
//
// Either way the statement returns the record and, last, whether the claim
// won it: on PostgreSQL whether the upsert returned it; on SQLite, where the
// returned row is always the current one, whether its owner is now the
// claimant's (owner tokens are fresh per claim).
func claimSQL(d Dialect, table string) string {
	insert := fmt.Sprintf(`INSERT INTO %[1]s AS t (scope_hash, principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at)
VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8, 1, $9, '', NULL, $10, NULL, NULL, NULL, $11, $11, 0)
ON CONFLICT (scope_hash) DO UPDATE SET`, table)
	if d == Postgres {
		return fmt.Sprintf(`WITH claimed AS (
%[3]s
	state = 1,
	owner = excluded.owner,
	generation = t.generation + 1,
	lease_until = excluded.lease_until,
	updated_at = excluded.updated_at,
	fingerprint = CASE WHEN t.state = 2 THEN excluded.fingerprint ELSE t.fingerprint END,
	fingerprint_version = CASE WHEN t.state = 2 THEN excluded.fingerprint_version ELSE t.fingerprint_version END,
	recovery_point = CASE WHEN t.state = 2 THEN '' ELSE t.recovery_point END,
	recovery_data = CASE WHEN t.state = 2 THEN NULL ELSE t.recovery_data END,
	request = CASE WHEN t.state = 2 THEN excluded.request ELSE t.request END,
	created_at = CASE WHEN t.state = 2 THEN excluded.created_at ELSE t.created_at END,
	response_status = NULL,
	response_header = NULL,
	response_body = NULL,
	completed_at = 0
WHERE %[4]s
RETURNING %[2]s
)
SELECT %[2]s, TRUE FROM claimed
UNION ALL
SELECT %[2]s, FALSE FROM (SELECT %[2]s FROM %[1]s WHERE scope_hash = $1 AND NOT EXISTS (SELECT 1 FROM claimed) FOR SHARE) cur`, table, columns, insert, claimWins)
	}
	// w is claimWins; r is "won, and restarts a completed record".
	w := claimWins
	r := "(" + claimWins + " AND t.state = 2)"
	return fmt.Sprintf(`%[2]s
	state = CASE WHEN %[3]s THEN 1 ELSE t.state END,
	owner = CASE WHEN %[3]s THEN excluded.owner ELSE t.owner END,
	generation = CASE WHEN %[3]s THEN t.generation + 1 ELSE t.generation END,
	lease_until = CASE WHEN %[3]s THEN excluded.lease_until ELSE t.lease_until END,
	updated_at = CASE WHEN %[3]s THEN excluded.updated_at ELSE t.updated_at END,
	fingerprint = CASE WHEN %[4]s THEN excluded.fingerprint ELSE t.fingerprint END,
	fingerprint_version = CASE WHEN %[4]s THEN excluded.fingerprint_version ELSE t.fingerprint_version END,
	recovery_point = CASE WHEN %[4]s THEN '' ELSE t.recovery_point END,
	recovery_data = CASE WHEN %[4]s THEN NULL ELSE t.recovery_data END,
	request = CASE WHEN %[4]s THEN excluded.request ELSE t.request END,
	created_at = CASE WHEN %[4]s THEN excluded.created_at ELSE t.created_at END,
	response_status = CASE WHEN %[3]s THEN NULL ELSE t.response_status END,
	response_header = CASE WHEN %[3]s THEN NULL ELSE t.response_header END,
	response_body = CASE WHEN %[3]s THEN NULL ELSE t.response_body END,
	completed_at = CASE WHEN %[3]s THEN 0 ELSE t.completed_at END
RETURNING %[1]s, owner = $8`, columns, insert, w, r)
}

func buildQueries(d Dialect, table string) queries {
	q := queries{
		claim: claimSQL(d, table),

		// A takeover-only claim (idempotency.Claim.TakeoverOnly): one
		// conditional UPDATE that wins only an in-progress record whose lease
		// ended before now ($4) with the same fingerprint and version, exactly
		// as the claim's takeover branch does (owner, generation + 1, lease,
		// update time; the rest kept). It never inserts and never restarts a
		// completed record.
		takeover: fmt.Sprintf(`UPDATE %[1]s SET owner = $2, generation = generation + 1, lease_until = $3, updated_at = $4
WHERE scope_hash = $1 AND state = 1 AND lease_until < $4 AND fingerprint = $5 AND fingerprint_version = $6
RETURNING %[2]s, TRUE`, table, columns),

		get: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE scope_hash = $1`, table, columns),

		heartbeat: fmt.Sprintf(`UPDATE %[1]s SET lease_until = $2
WHERE scope_hash = $1 AND owner = $3 AND generation = $4 AND state = 1`, table),

		complete: fmt.Sprintf(`UPDATE %[1]s SET state = 2, response_status = $2, response_header = $3,
	response_body = $4, completed_at = $5, updated_at = $5
WHERE scope_hash = $1 AND owner = $6 AND generation = $7 AND state = 1`, table),

		release: fmt.Sprintf(`DELETE FROM %[1]s
WHERE scope_hash = $1 AND owner = $2 AND generation = $3 AND state = 1`, table),

		setPoint: fmt.Sprintf(`UPDATE %[1]s SET recovery_point = $2, recovery_data = $3, updated_at = $4
WHERE scope_hash = $1 AND owner = $5 AND generation = $6 AND state = 1`, table),

		abandoned: fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE state = 1 AND lease_until < $1
ORDER BY lease_until, created_at, scope_hash
LIMIT $2`, table, columns),

		// Bounded: at most $2 rows per statement, chosen by primary key. The
		// conditions are repeated on the DELETE itself: on PostgreSQL under
		// READ COMMITTED, a row that a concurrent claim, heartbeat or
		// completion changed after the subquery saw it is re-checked against
		// the DELETE's own WHERE only, so without them the reaper would
		// delete a record that was just taken over or completed. On
		// PostgreSQL the subquery also locks its rows and skips the ones a
		// running write holds (FOR UPDATE SKIP LOCKED): the reaper never
		// waits for a claim, and a claim waiting for a row the reaper locked
		// inserts afresh once it is gone. SQLite serialises writers, so no
		// row changes under the statement there; the outer conditions are
		// kept for the same meaning.
		deleteBefore: fmt.Sprintf(`DELETE FROM %[1]s WHERE scope_hash IN (
	SELECT scope_hash FROM %[1]s
	WHERE updated_at < $1 AND (state = 2 OR lease_until < $1)
	ORDER BY updated_at
	LIMIT $2%[2]s)
  AND updated_at < $1 AND (state = 2 OR lease_until < $1)`, table, d.skipLocked()),
	}
	q.claim = d.rebind(q.claim)
	q.takeover = d.rebind(q.takeover)
	q.get = d.rebind(q.get)
	q.heartbeat = d.rebind(q.heartbeat)
	q.complete = d.rebind(q.complete)
	q.release = d.rebind(q.release)
	q.setPoint = d.rebind(q.setPoint)
	q.abandoned = d.rebind(q.abandoned)
	q.deleteBefore = d.rebind(q.deleteBefore)
	return q
}
