package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Dialect selects the SQL flavour the Store speaks. The zero value is not a
// valid dialect: use Postgres, SQLite or MySQL.
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
	// MySQL is MySQL 8.0 or later or MariaDB 10.6 or later, with InnoDB
	// tables, for a fleet of servers sharing one store. Tested with the
	// github.com/go-sql-driver/mysql driver (driver name "mysql"); see the
	// package documentation, "MySQL and MariaDB".
	MySQL
)

// String returns "postgres", "sqlite", "mysql" or "Dialect(n)" for an
// invalid value.
func (d Dialect) String() string {
	switch d {
	case Postgres:
		return "postgres"
	case SQLite:
		return "sqlite"
	case MySQL:
		return "mysql"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

func (d Dialect) valid() bool { return d == Postgres || d == SQLite || d == MySQL }

// DialectError is returned by Open when the database behind the *sql.DB is
// not the one the Dialect names: a SQLite pool declared Postgres, a
// PostgreSQL or MySQL pool declared SQLite, and so on, or a database that is
// none of them.
type DialectError struct {
	Declared Dialect // the Dialect given to Open
	Found    Dialect // the database found: Postgres, SQLite, MySQL, or 0 when none
	Server   string  // what the database reported, such as "PostgreSQL 15.2", "SQLite 3.50.4" or "MariaDB 10.11.6"
}

// Error names both dialects.
func (e *DialectError) Error() string {
	if e.Found.valid() {
		return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is %s (%s)", e.Declared, e.Found, e.Server)
	}
	return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is not %s (it reports %q)", e.Declared, e.Declared, e.Server)
}

// openTimeout bounds the queries Open runs to check the database.
const openTimeout = 10 * time.Second

// checkDialect identifies the database behind db with the query of the
// declared dialect d, and when that fails or names another database, with
// the other dialects', so that a *DialectError names what was found. When
// no query answers, it returns the declared query's error as an *OpError
// with Op "open".
func checkDialect(ctx context.Context, db *sql.DB, d Dialect) error {
	found, server, err := identify(ctx, db, d)
	if err == nil && found == d {
		return nil
	}
	for _, other := range []Dialect{Postgres, SQLite, MySQL} {
		if other == d {
			continue
		}
		if f, s, oerr := identify(ctx, db, other); oerr == nil && f == other {
			return &DialectError{Declared: d, Found: other, Server: s}
		}
	}
	if err != nil {
		return opErr("open", err)
	}
	return &DialectError{Declared: d, Server: server}
}

// identify asks db what it is with d's query: SQLite answers
// sqlite_version(), PostgreSQL answers version() with "PostgreSQL <version>
// ...", MySQL and MariaDB answer @@version (identifyMySQL). It returns the
// dialect found (0 when the answer names none) and the database's name and
// version.
func identify(ctx context.Context, db *sql.DB, d Dialect) (Dialect, string, error) {
	if d == MySQL {
		return identifyMySQL(ctx, db)
	}
	var v string
	if d == SQLite {
		if err := db.QueryRowContext(ctx, "SELECT sqlite_version()").Scan(&v); err != nil {
			return 0, "", err
		}
		return SQLite, "SQLite " + v, nil
	}
	if err := db.QueryRowContext(ctx, "SELECT version()").Scan(&v); err != nil {
		return 0, "", err
	}
	f := strings.Fields(v)
	server := strings.Join(f[:min(len(f), 2)], " ")
	if len(f) > 0 && f[0] == "PostgreSQL" {
		return Postgres, server, nil
	}
	return 0, server, nil
}

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
// index rows over 2704 bytes). The parts are kept as bytes beside it, and so
// is the recovery point. Times are INTEGER/BIGINT nanoseconds since the Unix
// epoch, UTC, so that comparisons are exact in both dialects; 0 means "not
// set" (completed_at of an in-progress record).
func schema(d Dialect, table string) string {
	if d == MySQL {
		return mysqlSchema(table)
	}
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
CREATE INDEX IF NOT EXISTS %[1]s_lease_idx ON %[1]s (state, lease_until);
CREATE INDEX IF NOT EXISTS %[1]s_updated_idx ON %[1]s (updated_at);
`, table, blob)
}

// queries holds the statements of one Store, built once at Open.
type queries struct {
	claim, takeover, existing, get, heartbeat, complete, release, setPoint, abandoned, deleteBefore string

	mysql *mysqlQueries // MySQL's own statements; nil on the other dialects
}

// Every claim statement returns at most one row of fifteen columns: an
// outcome (rowExisting, rowCreated, rowTakenOver, rowOtherScope), the
// generation, then the columns only a takeover needs (recovery point, its
// data, the request, created_at) and those only an existing record needs
// (state, fingerprint and version, owner, lease, completion time, response).
// The columns an outcome does not need are NULL; a created record's other
// fields are the claim's own. scanClaim reads the row.
const (
	rowExisting   = 0
	rowCreated    = 1
	rowTakenOver  = 2
	rowOtherScope = 3 // the row under the scope's digest holds other scope parts
)

// wonRow is the row of a claim that created or took over the record, from
// the columns of the row it wrote; now is the claim time's placeholder. A
// record whose created_at is the claim's time was created by it (a takeover
// keeps an earlier one: the lease it took over ended before now).
func wonRow(now string) string {
	return fmt.Sprintf(`CASE WHEN created_at = %[1]s THEN %[2]d ELSE %[3]d END, generation, recovery_point, recovery_data,
	CASE WHEN created_at = %[1]s THEN NULL ELSE request END, created_at,
	NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL`, now, rowCreated, rowTakenOver)
}

// takenOverRow is wonRow for the takeover-only claim, which never creates.
var takenOverRow = fmt.Sprintf(`%d, generation, recovery_point, recovery_data, request, created_at,
	NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL`, rowTakenOver)

// existingRow is the row of a claim that changed nothing, read from a
// record selected by $1 (the digest); $2 to $5 are the scope parts it is
// compared with.
var existingRow = fmt.Sprintf(`CASE WHEN principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	THEN %d ELSE %d END, generation, NULL, NULL, NULL, NULL,
	state, fingerprint, fingerprint_version, owner, lease_until, completed_at,
	response_status, response_header, response_body`, rowExisting, rowOtherScope)

// claimSQL returns the claim statement. Its core is one INSERT ... ON
// CONFLICT DO UPDATE whose WHERE lets the claim win an existing row only if
// the row holds the claim's own scope parts (a digest collision never
// overwrites another scope's record) and either it completed before the
// replay window's cutoff ($12) or its lease ended before now ($11) with the
// same fingerprint and version. A restart of a completed record clears it
// and takes the new request; a takeover keeps the recovery point, its data,
// the request and created_at. RETURNING gives wonRow when it wrote.
//
// On PostgreSQL the core runs in a CTE and the statement returns, when the
// core wrote nothing, the existing row, read FOR SHARE: under READ COMMITTED
// a locking read returns the row's latest committed version (a claim that
// waited for another transaction answers what that one left), and it never
// waits, since ON CONFLICT holds the row's lock already. The one case where
// it returns no row is a conflicting row inserted by a transaction that
// committed after the statement began (ON CONFLICT sees it, the snapshot
// does not).
//
// SQLite has no data-modifying CTE, and RETURNING gives only the rows a
// statement wrote, so the statement is the core alone: a claim that loses
// writes nothing and returns no row, and Claim reads the existing row with a
// second statement (queries.existing).
func claimSQL(d Dialect, table string) string {
	core := fmt.Sprintf(`INSERT INTO %[1]s AS t (scope_hash, principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at)
VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8, 1, $9, '', NULL, $10, NULL, NULL, NULL, $11, $11, 0)
ON CONFLICT (scope_hash) DO UPDATE SET
	state = 1,
	owner = excluded.owner,
	generation = t.generation + 1,
	lease_until = excluded.lease_until,
	updated_at = excluded.updated_at,
	fingerprint = excluded.fingerprint,
	fingerprint_version = excluded.fingerprint_version,
	recovery_point = CASE WHEN t.state = 2 THEN excluded.recovery_point ELSE t.recovery_point END,
	recovery_data = CASE WHEN t.state = 2 THEN NULL ELSE t.recovery_data END,
	request = CASE WHEN t.state = 2 THEN excluded.request ELSE t.request END,
	created_at = CASE WHEN t.state = 2 THEN excluded.created_at ELSE t.created_at END,
	response_status = NULL,
	response_header = NULL,
	response_body = NULL,
	completed_at = 0
WHERE t.principal = excluded.principal AND t.method = excluded.method
	AND t.route = excluded.route AND t.idem_key = excluded.idem_key
	AND ((t.state = 2 AND t.completed_at < $12)
	  OR (t.state = 1 AND t.lease_until < $11 AND t.fingerprint = excluded.fingerprint
	      AND t.fingerprint_version = excluded.fingerprint_version))
RETURNING `, table)
	if d == SQLite {
		return core + wonRow("$11")
	}
	return fmt.Sprintf(`WITH claimed AS (
%[2]sgeneration, recovery_point, recovery_data, request, created_at
)
SELECT %[3]s
FROM claimed
UNION ALL
SELECT %[4]s
FROM (SELECT principal, method, route, idem_key, generation, state, fingerprint, fingerprint_version,
	owner, lease_until, completed_at, response_status, response_header, response_body
	FROM %[1]s WHERE scope_hash = $1 AND NOT EXISTS (SELECT 1 FROM claimed) FOR SHARE) cur`,
		table, core, wonRow("$11"), existingRow)
}

func buildQueries(d Dialect, table string) queries {
	if d == MySQL {
		return buildMySQLQueries(table)
	}
	q := queries{
		claim: claimSQL(d, table),

		// A takeover-only claim (idempotency.Claim.TakeoverOnly): one
		// conditional UPDATE with the takeover branch of the claim's
		// condition (same scope parts, in progress, lease ended before now
		// ($10), same fingerprint and version). It never inserts and never
		// restarts a completed record.
		takeover: fmt.Sprintf(`UPDATE %[1]s SET owner = $8, generation = generation + 1, lease_until = $9, updated_at = $10
WHERE scope_hash = $1 AND principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	AND state = 1 AND lease_until < $10 AND fingerprint = $6 AND fingerprint_version = $7
RETURNING %[2]s`, table, takenOverRow),

		// The record a claim did not win, read when its statement returned
		// no row.
		existing: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE scope_hash = $1`, table, existingRow),

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
	q.existing = d.rebind(q.existing)
	q.get = d.rebind(q.get)
	q.heartbeat = d.rebind(q.heartbeat)
	q.complete = d.rebind(q.complete)
	q.release = d.rebind(q.release)
	q.setPoint = d.rebind(q.setPoint)
	q.abandoned = d.rebind(q.abandoned)
	q.deleteBefore = d.rebind(q.deleteBefore)
	return q
}
