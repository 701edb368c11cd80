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
// idempotent (IF NOT EXISTS). Times are INTEGER/BIGINT nanoseconds since the
// Unix epoch, UTC, so that comparisons are exact in both dialects; 0 means
// "not set" (completed_at of an in-progress record).
func schema(d Dialect, table string) string {
	blob := d.blobType()
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	principal           TEXT     NOT NULL,
	method              TEXT     NOT NULL,
	route               TEXT     NOT NULL,
	idem_key            TEXT     NOT NULL,
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
	response_header     TEXT,              -- JSON object of header name to values
	response_body       %[2]s,
	created_at          BIGINT   NOT NULL,
	updated_at          BIGINT   NOT NULL,
	completed_at        BIGINT   NOT NULL DEFAULT 0, -- 0 until completed
	PRIMARY KEY (principal, method, route, idem_key)
);
CREATE INDEX IF NOT EXISTS %[1]s_lease_idx ON %[1]s (state, lease_until);
CREATE INDEX IF NOT EXISTS %[1]s_updated_idx ON %[1]s (updated_at);
`, table, blob)
}

// queries holds the statements of one Store, built once at Open.
type queries struct {
	claim, takeover, get, heartbeat, complete, release, setPoint, abandoned, deleteBefore string
}

func buildQueries(d Dialect, table string) queries {
	q := queries{
		// One atomic statement decides the claim. The WHERE of DO UPDATE
		// admits exactly two ways to win an existing row: a completed record
		// that fell out of the replay window ($11) starts over, and an
		// in-progress record whose lease expired before now ($12) with the
		// same fingerprint (and fingerprint version) is taken over (recovery point, request and
		// creation time kept). Either way the generation is bumped. When the
		// WHERE is false nothing is returned and the caller reads the row.
		claim: fmt.Sprintf(`INSERT INTO %[1]s AS t (principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at)
VALUES ($1, $2, $3, $4, 1, $5, $6, $7, 1, $8, '', NULL, $9, NULL, NULL, NULL, $10, $10, 0)
ON CONFLICT (principal, method, route, idem_key) DO UPDATE SET
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
WHERE (t.state = 2 AND t.completed_at < $11)
   OR (t.state = 1 AND t.lease_until < $12 AND t.fingerprint = excluded.fingerprint
       AND t.fingerprint_version = excluded.fingerprint_version)
RETURNING %[2]s`, table, columns),

		// A takeover-only claim (idempotency.Claim.TakeoverOnly): one
		// conditional UPDATE that wins only an in-progress record whose lease
		// ended before now ($7) with the same fingerprint and version, exactly
		// as the claim's takeover branch does (owner, generation + 1, lease,
		// update time; the rest kept). It never inserts and never restarts a
		// completed record.
		takeover: fmt.Sprintf(`UPDATE %[1]s SET owner = $5, generation = generation + 1, lease_until = $6, updated_at = $7
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4
  AND state = 1 AND lease_until < $7 AND fingerprint = $8 AND fingerprint_version = $9
RETURNING %[2]s`, table, columns),

		get: fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4`, table, columns),

		heartbeat: fmt.Sprintf(`UPDATE %[1]s SET lease_until = $5
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4
  AND owner = $6 AND generation = $7 AND state = 1`, table),

		complete: fmt.Sprintf(`UPDATE %[1]s SET state = 2, response_status = $5, response_header = $6,
	response_body = $7, completed_at = $8, updated_at = $8
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4
  AND owner = $9 AND generation = $10 AND state = 1`, table),

		release: fmt.Sprintf(`DELETE FROM %[1]s
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4
  AND owner = $5 AND generation = $6 AND state = 1`, table),

		setPoint: fmt.Sprintf(`UPDATE %[1]s SET recovery_point = $5, recovery_data = $6, updated_at = $7
WHERE principal = $1 AND method = $2 AND route = $3 AND idem_key = $4
  AND owner = $8 AND generation = $9 AND state = 1`, table),

		abandoned: fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE state = 1 AND lease_until < $1
ORDER BY lease_until, created_at, principal, method, route, idem_key
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
		deleteBefore: fmt.Sprintf(`DELETE FROM %[1]s WHERE (principal, method, route, idem_key) IN (
	SELECT principal, method, route, idem_key FROM %[1]s
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
