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
	// Server is what the database reported, such as "PostgreSQL 15.2",
	// "SQLite 3.50.4" or "MariaDB 10.11.6".
	Server string
}

// Error names both dialects.
func (e *DialectError) Error() string {
	if e.Found.valid() {
		return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is %s (%s)",
			e.Declared, e.Found, e.Server)
	}
	return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is not %s (it reports %q)",
		e.Declared, e.Declared, e.Server)
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

// placeholder is a $N placeholder.
var placeholder = regexp.MustCompile(`\$[0-9]+`)

// rebind turns the $N placeholders the queries are written with into the
// dialect's own: PostgreSQL keeps $N, SQLite gets its numbered ?N form and
// MySQL a bare ?, which binds by position: every statement MySQL runs names
// its placeholders in the order of the text, each once (the internal test
// TestMySQLPlaceholdersAreInTextOrder checks them).
func (d Dialect) rebind(q string) string {
	switch d {
	case Postgres:
		return q
	case MySQL:
		return placeholder.ReplaceAllString(q, "?")
	}
	return strings.ReplaceAll(q, "$", "?")
}

// DefaultTable is the table name used when WithTable is not given.
const DefaultTable = "idempotency_records"

// maxTableLen keeps the derived names ("<table>_pending_idx",
// "<table>_leases_idx") within PostgreSQL's 63-byte identifier limit
// (MySQL's is 64).
const maxTableLen = 48

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// validTable reports whether name is an unquoted SQL identifier that every
// dialect accepts as it is: ASCII letters, digits and underscores, not
// starting with a digit, 1 to 48 characters.
func validTable(name string) bool {
	return len(name) > 0 && len(name) <= maxTableLen && identRE.MatchString(name)
}

// columns is the list every query that reads a whole record selects, in the
// order scanRecord expects.
const columns = `principal, method, route, idem_key, state, fingerprint, fingerprint_version,
	owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at`

// schema returns the DDL for table in dialect d (MySQL's is mysqlSchema).
// Every statement is idempotent (IF NOT EXISTS). The primary key is
// scope_hash, the SHA-256 of the length-prefixed scope parts (see
// scopeHash): 32 bytes whatever the parts hold, so that any bytes of any
// length work as a principal, method, route or key (PostgreSQL refuses
// invalid UTF-8 and NUL in TEXT, and B-tree index rows over 2704 bytes).
// The parts are kept as bytes beside it, and so is the recovery point.
// Times are INTEGER/BIGINT nanoseconds since the Unix epoch, UTC, so that
// comparisons are exact in every dialect; 0 means "not set" (completed_at
// of an in-progress record).
//
// SQLite's two partial indexes serve the background jobs and nothing else:
// the records in progress by lease end (the Completer's and the Reaper's
// Abandoned), and the completed records by completion time (the Reaper's
// DeleteBefore). A record is in one of them at a time, so a claim adds two
// index entries (the primary key's and the first index's) and a completion
// two (the primary key's and the second's).
//
// PostgreSQL indexes no column a completion changes, so that a completion is
// a HOT update (one that changes no indexed column, predicates included,
// writes no index entry and stays on its page, kept free by a fillfactor of
// 80): the table's one index beside the primary key is on created_at (the
// Reaper's completed records, oldest first), and the records in progress are
// listed in a second table, <table>_leases, one row per record in progress
// holding its lease end, indexed by it (the Completer's and the Reaper's
// Abandoned). Every statement that starts, moves or ends a lease writes both
// tables, as one statement (see pgLeases). A claim adds four index entries
// (both tables' primary keys, created_at, the lease end), a completion none,
// and a heartbeat or a takeover two, on the small table. A recovery point
// changes no indexed column in either dialect (on PostgreSQL a HOT update).
func schema(d Dialect, table string) string {
	if d == MySQL {
		return mysqlSchema(table)
	}
	blob, with := d.blobType(), ""
	indexes := fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s_pending_idx ON %[1]s (lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS %[1]s_done_idx ON %[1]s (completed_at) WHERE state = 2;
`, table)
	if d == Postgres {
		with = " WITH (fillfactor = " + fillFactor + ")"
		indexes = fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %[1]s_created_idx ON %[1]s (created_at);
CREATE TABLE IF NOT EXISTS %[1]s_leases (
	scope_hash  BYTEA  NOT NULL PRIMARY KEY, -- a record of %[1]s in progress
	lease_until BIGINT NOT NULL              -- its lease end, as the record holds it
);
CREATE INDEX IF NOT EXISTS %[1]s_leases_idx ON %[1]s_leases (lease_until);
`, table)
	}
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
)%[3]s;
%[4]s`, table, blob, with, indexes)
}

// fillFactor is the PostgreSQL table's fillfactor: inserts leave a fifth of
// each page free, for the row versions its updates write.
const fillFactor = "80"

// oldIndexes are the names of the indexes of earlier layouts that Migrate
// drops: (state, lease_until) and (updated_at), which every update but a
// heartbeat changed, and on PostgreSQL the partial indexes whose predicate
// a completion changed.
func oldIndexes(d Dialect, table string) []string {
	old := []string{table + "_lease_idx", table + "_updated_idx"}
	if d == Postgres {
		old = append(old, table+"_pending_idx", table+"_done_idx")
	}
	return old
}

// queries holds the statements of one Store, built once at Open. The reads
// and the recovery point are one text for every dialect, and so are the
// other fenced writes and Abandoned but on PostgreSQL, whose own keep its
// list of leases (pgQueries). claim, takeover, restart and deleteBefore are
// PostgreSQL's and SQLite's, and mysql holds the statements MySQL runs in
// their place.
type queries struct {
	get, existing, heartbeat, complete, release, setPoint, abandoned string
	claim, takeover, restart, deleteBefore                           string

	mysql mysqlQueries
}

// Every statement that decides a claim, and the read of the record a claim
// did not win, returns at most one row of fifteen columns: an outcome
// (rowExisting, rowCreated, rowTakenOver, rowOtherScope), the generation,
// then the columns only a takeover needs (recovery point, its data, the
// request, created_at) and those only an existing record needs (state,
// fingerprint and version, owner, lease, completion time, response). The
// columns an outcome does not need are NULL (or, for a created record,
// ignored: its other fields are the claim's own). scanClaim reads the row.
const (
	rowExisting   = 0
	rowCreated    = 1
	rowTakenOver  = 2
	rowOtherScope = 3 // the row under the scope's digest holds other scope parts
)

// won is what the statement that wins a record returns after its outcome;
// nineNulls completes the row.
const (
	won       = `generation, recovery_point, recovery_data, request, created_at`
	nineNulls = `NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL`
)

// existingRow is the row of a record a claim did not win, read from the
// row under the scope's digest and compared with the scope parts p (four
// placeholders).
func existingRow(p ...string) string {
	return fmt.Sprintf(`CASE
	WHEN principal = %s AND method = %s AND route = %s AND idem_key = %s THEN %d ELSE %d END,
	generation, NULL, NULL, NULL, NULL,
	state, fingerprint, fingerprint_version, owner, lease_until, completed_at,
	response_status, response_header, response_body`, p[0], p[1], p[2], p[3],
		rowExisting, rowOtherScope)
}

// The parameters of the statements that decide a claim (claimArgs): $1 the
// digest, $2 to $5 the scope parts, $6 and $7 the fingerprint and its
// version, $8 the owner, $9 the lease end, $10 now, $11 the request, $12
// the replay window's cutoff. The takeover uses $1 to $10 only.
//
// A claim wins an existing row only if the row holds the claim's own scope
// parts (a digest collision never overwrites another scope's record), and
// then in one of two ways, each its own statement or CTE, so that the
// outcome is the statement's and never inferred from what the row holds
// afterwards: it takes over a record in progress whose lease ended before
// now with the same fingerprint and version (takeoverWhere), keeping its
// recovery point, its data, its request and created_at (takeoverSet); or it
// restarts a record that completed before the replay window's cutoff
// (restartWhere), as a fresh record with the next generation (restartSet).
const (
	takeoverSet   = `owner = $8, generation = generation + 1, lease_until = $9, updated_at = $10`
	takeoverWhere = `principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	AND state = 1 AND lease_until < $10 AND fingerprint = $6 AND fingerprint_version = $7`
	restartSet = `state = 1, owner = $8, generation = generation + 1, lease_until = $9,
	updated_at = $10, fingerprint = $6, fingerprint_version = $7, recovery_point = '',
	recovery_data = NULL, request = $11, created_at = $10,
	response_status = NULL, response_header = NULL, response_body = NULL, completed_at = 0`
	restartWhere = `principal = $2 AND method = $3 AND route = $4 AND idem_key = $5
	AND state = 2 AND completed_at < $12`
)

// insertCols and insertVals are the columns and values of a new record.
const (
	insertCols = `scope_hash, principal, method, route, idem_key, state, fingerprint,
	fingerprint_version, owner, generation, lease_until, recovery_point, recovery_data, request,
	response_status, response_header, response_body, created_at, updated_at, completed_at`
	insertVals = `$1, $2, $3, $4, $5, 1, $6, $7, $8, 1, $9, '', NULL, $11,
	NULL, NULL, NULL, $10, $10, 0`
)

// claimSQL returns the first statement of a claim on PostgreSQL or SQLite
// (see claimArgs for its parameters).
//
// On PostgreSQL it is one statement that reads before it writes and
// decides every claim: a CTE reads the row under the digest from the
// statement's snapshot (a plain read: no lock, no transaction ID); one
// UPDATE restarts that row and another takes it over, each only under its
// condition (at most one of them matches a row); an INSERT ... ON CONFLICT
// DO NOTHING creates the record only when the snapshot holds no row. The
// statement returns the row it wrote, tagged by the CTE that wrote it, or
// else the row it read (existingRow). A replay or an in-progress conflict
// therefore writes nothing and waits for no one: its UPDATEs match no row
// of the snapshot and its INSERTs have no input, so no tuple is locked and no
// WAL is written. Only a claim that would win waits for a row another
// transaction holds, and then re-checks its condition on the row's latest
// version (READ COMMITTED). It returns no row when its INSERT met a row
// committed after its snapshot, and the row of its snapshot when its UPDATE
// found the row changed or gone: Claim then reads the record again (see
// Claim).
//
// SQLite has no data-modifying CTE, and its RETURNING gives only the rows a
// statement wrote, as they are after it. The statement is an INSERT ... ON
// CONFLICT DO UPDATE SET takeoverSet WHERE takeoverWhere: it creates the
// record or takes it over, and the generation it returns tells which (an
// INSERT writes generation 1, a takeover the next one after a generation of
// at least 1). A claim that does neither writes nothing and returns no row;
// Claim then reads the existing row, and restarts a completed record past
// the window with a second statement (queries.restart). Its parameters are
// $1 to $11.
func claimSQL(d Dialect, table string) string {
	if d == SQLite {
		return fmt.Sprintf(`INSERT INTO %[1]s (%[2]s)
VALUES (%[3]s)
ON CONFLICT (scope_hash) DO UPDATE SET %[4]s
WHERE %[5]s
RETURNING CASE generation WHEN 1 THEN %[6]d ELSE %[7]d END, %[8]s, %[9]s`,
			table, insertCols, insertVals, takeoverSet, takeoverWhere, rowCreated,
			rowTakenOver, won, nineNulls)
	}
	return fmt.Sprintf(`WITH cur AS (
	SELECT principal, method, route, idem_key, generation, state, fingerprint, fingerprint_version,
		owner, lease_until, completed_at, response_status, response_header, response_body
	FROM %[1]s WHERE scope_hash = $1
), restarted AS (
	UPDATE %[1]s SET %[4]s
	WHERE scope_hash = $1 AND %[5]s
	RETURNING %[8]d, %[10]s
), taken AS (
	UPDATE %[1]s SET %[6]s
	WHERE scope_hash = $1 AND %[7]s
	RETURNING %[9]d, %[10]s
), created AS (
	INSERT INTO %[1]s (%[2]s)
	SELECT %[3]s WHERE NOT EXISTS (SELECT 1 FROM cur)
	ON CONFLICT (scope_hash) DO NOTHING
	RETURNING %[8]d, %[10]s
), w AS (
	SELECT * FROM restarted UNION ALL SELECT * FROM taken UNION ALL SELECT * FROM created
), leased AS (
	%[13]s
)
SELECT w.*, %[11]s FROM w
UNION ALL
SELECT %[12]s FROM cur
WHERE NOT EXISTS (SELECT 1 FROM restarted) AND NOT EXISTS (SELECT 1 FROM taken)`,
		table, insertCols, insertVals, restartSet, restartWhere, takeoverSet, takeoverWhere,
		rowCreated, rowTakenOver, won, nineNulls, existingRow("$2", "$3", "$4", "$5"),
		leaseUpsert(table, "w", "$1", "$9"))
}

// pgLeases keeps PostgreSQL's <table>_leases (see schema) in step with the
// table: each statement that wins a record, moves its lease or ends it is a
// data-modifying CTE on the table (rec) followed by one on the leases that
// reads rec's RETURNING rows, so that both change in one statement or
// neither, and the leases' row is locked only after the record's. The
// statement returns rec's rows, and reports their count as the rows it
// affected (a SELECT's command tag), which the fence reads.
func pgLeases(rec, lease string) string {
	return fmt.Sprintf(`WITH rec AS (
	%s
), lease AS (
	%s
)
SELECT * FROM rec`, rec, lease)
}

// leaseUpsert writes the lease end until of the record whose digest is hash
// for each row of from (at most one): a new row when the record starts, the
// new end when its lease moves.
func leaseUpsert(table, from, hash, until string) string {
	return fmt.Sprintf(`INSERT INTO %[1]s_leases (scope_hash, lease_until) SELECT %[3]s, %[4]s FROM %[2]s
	ON CONFLICT (scope_hash) DO UPDATE SET lease_until = EXCLUDED.lease_until`, table, from, hash, until)
}

// leaseDelete deletes the leases of the records whose digests rec returned.
func leaseDelete(table string) string {
	return fmt.Sprintf(`DELETE FROM %[1]s_leases WHERE scope_hash IN (SELECT scope_hash FROM rec)`, table)
}

func buildQueries(d Dialect, table string) queries {
	q := sharedQueries(table)
	if d == MySQL {
		q.mysql = buildMySQLQueries(table)
	} else {
		q.claim = claimSQL(d, table)

		// A takeover-only claim (idempotency.Claim.TakeoverOnly), and the
		// takeover of a record that a claim read after its first
		// statement: one conditional UPDATE. It never inserts and never
		// restarts a completed record.
		q.takeover = fmt.Sprintf(`UPDATE %[1]s SET %[2]s
WHERE scope_hash = $1 AND %[3]s
RETURNING %[4]d, %[5]s, %[6]s`, table, takeoverSet, takeoverWhere, rowTakenOver, won, nineNulls)

		// The restart of a completed record past the replay window that a
		// claim read after its first statement.
		q.restart = fmt.Sprintf(`UPDATE %[1]s SET %[2]s
WHERE scope_hash = $1 AND %[3]s
RETURNING %[4]d, %[5]s, %[6]s`, table, restartSet, restartWhere, rowCreated, won, nineNulls)

		// SQLite's (PostgreSQL's is in pgQueries). Bounded: at most $2
		// rows per statement, chosen by primary key from the two partial
		// indexes: completed records first, oldest completion first (for a
		// completed record updated_at is completed_at), then records in
		// progress whose lease and last update are both past the horizon.
		// SQLite serialises writers, so no row changes under the
		// statement; the conditions are repeated on the DELETE itself for
		// the meaning PostgreSQL's need (see pgQueries).
		q.deleteBefore = fmt.Sprintf(`DELETE FROM %[1]s WHERE scope_hash IN (
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 2 AND completed_at < $1 AND updated_at < $1
		ORDER BY completed_at LIMIT $2) done
	UNION ALL
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 1 AND lease_until < $1 AND updated_at < $1
		ORDER BY lease_until LIMIT $2) unfinished
	LIMIT $2)
  AND updated_at < $1 AND (state = 2 OR lease_until < $1)`, table)
	}
	if d == Postgres {
		pgQueries(&q, table)
	}
	m := &q.mysql
	for _, p := range []*string{&q.get, &q.existing, &q.heartbeat, &q.complete, &q.release,
		&q.setPoint, &q.abandoned, &q.claim, &q.takeover, &q.restart, &q.deleteBefore,
		&m.insert, &m.locked, &m.takeover, &m.restart, &m.held, &m.stale, &m.deleteBefore} {
		*p = d.rebind(*p)
	}
	return q
}

// sharedQueries returns the statements whose text every dialect shares,
// but for those PostgreSQL has of its own (see pgQueries), with $N
// placeholders.
func sharedQueries(table string) queries {
	return queries{
		get: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE scope_hash = $1`, table, columns),

		// The record a claim did not win, read when its first statement
		// returned no row or one it would have won.
		existing: fmt.Sprintf(`SELECT %[2]s FROM %[1]s WHERE scope_hash = $5`,
			table, existingRow("$1", "$2", "$3", "$4")),

		// The fenced writes: each changes the record only while the lease
		// (owner and generation) holds it in progress.
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

// pgQueries gives PostgreSQL the statements that keep <table>_leases in step
// with the table (see pgLeases), in place of the shared ones: each writes
// the record as the shared statement does, then its lease. The reads of the
// records in progress go through the leases' index, and re-check the
// record's own state and lease end.
func pgQueries(q *queries, table string) {
	upsert := func(until string) string { return leaseUpsert(table, "rec", "$1", until) }
	q.takeover = pgLeases(q.takeover, upsert("$9"))
	q.restart = pgLeases(q.restart, upsert("$9"))
	q.heartbeat = pgLeases(q.heartbeat+"\nRETURNING scope_hash",
		leaseUpsert(table, "rec", "scope_hash", "$1"))
	q.complete = pgLeases(q.complete+"\nRETURNING scope_hash", leaseDelete(table))
	q.release = pgLeases(q.release+"\nRETURNING scope_hash", leaseDelete(table))

	// pending joins the records in progress whose lease ended before $1,
	// read from the leases' index in lease order, to their records.
	pending := fmt.Sprintf(`%[1]s JOIN (SELECT scope_hash AS pending_hash, lease_until AS pending_until
	FROM %[1]s_leases WHERE lease_until < $1) p ON scope_hash = pending_hash
WHERE state = 1 AND lease_until < $1`, table)
	q.abandoned = fmt.Sprintf(`SELECT %[2]s FROM %[1]s
ORDER BY pending_until, created_at, scope_hash
LIMIT $2`, pending, columns)

	// Bounded: at most $2 rows per statement, chosen by primary key:
	// records in progress whose lease and last update are both past the
	// horizon first, from the leases, whose rows leave with their records;
	// then completed records, oldest first, from the index on created_at (a
	// record completes after it is created, so completed_at < $1 implies
	// created_at < $1 but for the servers' clock skew, which only delays a
	// deletion; the records in progress that the index also lists are
	// mostly the stale ones, which the first part deleted). The conditions
	// are repeated on the DELETE itself: under READ COMMITTED, a row that a
	// concurrent claim, heartbeat or completion changed after the subquery
	// saw it is re-checked against the DELETE's own WHERE only, so without
	// them the reaper would delete a record that was just taken over or
	// completed. The subqueries lock their rows, a record in progress with
	// its lease, and skip the ones a running write holds (FOR UPDATE SKIP
	// LOCKED): the reaper never waits for a claim, a claim waiting for a
	// row the reaper locked inserts afresh once it is gone, and a record
	// whose lease ended and began again since the statement's snapshot (a
	// completion, then a restart) is skipped, never deleted without its
	// new lease.
	q.deleteBefore = fmt.Sprintf(`WITH rec AS (
	DELETE FROM %[1]s WHERE scope_hash IN (
		SELECT scope_hash FROM (SELECT r.scope_hash FROM %[1]s r
			JOIN %[1]s_leases l ON l.scope_hash = r.scope_hash
			WHERE l.lease_until < $1 AND r.state = 1 AND r.lease_until < $1 AND r.updated_at < $1
			ORDER BY l.lease_until LIMIT $2 FOR UPDATE OF r, l SKIP LOCKED) unfinished
		UNION ALL
		SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
			WHERE created_at < $1 AND state = 2 AND completed_at < $1 AND updated_at < $1
			ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED) done
		LIMIT $2)
	  AND updated_at < $1 AND (state = 2 OR lease_until < $1)
	RETURNING scope_hash
), lease AS (
	%[2]s
)
SELECT * FROM rec`, table, leaseDelete(table))
}
