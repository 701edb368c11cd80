package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
)

// postgresDialect is PostgreSQL's: its SQL, and the steps that upgrade a
// table of an earlier layout.
type postgresDialect struct{ returning }

func (postgresDialect) name() string { return "postgres" }

// identify reads version(), which PostgreSQL answers "PostgreSQL <version>
// ...".
func (postgresDialect) identify(ctx context.Context, db *sql.DB) (bool, string, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT version()").Scan(&v); err != nil {
		return false, "", err
	}
	f := strings.Fields(v)
	return len(f) > 0 && f[0] == "PostgreSQL", strings.Join(f[:min(len(f), 2)], " "), nil
}

func (postgresDialect) check(context.Context, *sql.DB) error { return nil }

// prepared is false: pgx caches the statements it runs on each connection
// itself, and database/sql's prepared statements measured no faster.
func (postgresDialect) prepared() bool { return false }

// txOptions: a unit runs READ COMMITTED whatever the server's or session's
// default. The fence relies on a conditional write that waited for a row
// changed by a concurrent takeover re-reading the row and matching nothing
// (ErrLeaseLost), where REPEATABLE READ or SERIALIZABLE fail it with
// SQLSTATE 40001.
func (postgresDialect) txOptions() *sql.TxOptions {
	return &sql.TxOptions{Isolation: sql.LevelReadCommitted}
}

// fillFactor is the table's fillfactor: inserts leave a fifth of each page
// free, for the row versions its updates write.
const fillFactor = "80"

// schema is the table of schemaFmt in PostgreSQL's types, with its
// indexes. The primary key is scope_hash, the SHA-256 of the
// length-prefixed scope parts (see scopeHash): 32 bytes whatever the parts
// hold, so that any bytes of any length work as a principal, method, route
// or key (PostgreSQL refuses invalid UTF-8 and NUL in TEXT, and B-tree index
// rows over 2704 bytes).
//
// No column a completion changes is indexed, so that a completion is a HOT
// update (one that changes no indexed column, predicates included, writes
// no index entry and stays on its page, kept free by a fillfactor of 80):
// the table's one index beside the primary key is on created_at (the
// Reaper's completed records, oldest first), and the records in progress
// are listed in a second table, <table>_leases, one row per record in
// progress holding its lease end, indexed by it (the Completer's and the
// Reaper's Abandoned). Every statement that starts, moves or ends a lease
// writes both tables, as one statement (see pgLeases). A claim adds four
// index entries (both tables' primary keys, created_at, the lease end), a
// completion none, and a heartbeat or a takeover two, on the small table.
// A recovery point changes no indexed column (a HOT update).
func (postgresDialect) schema(table string) string {
	return fmt.Sprintf(schemaFmt, table, "BYTEA", " WITH (fillfactor = "+fillFactor+")") +
		fmt.Sprintf(`;
CREATE INDEX IF NOT EXISTS %[1]s_created_idx ON %[1]s (created_at);
CREATE TABLE IF NOT EXISTS %[1]s_leases (
	scope_hash  BYTEA  NOT NULL PRIMARY KEY, -- a record of %[1]s in progress
	lease_until BIGINT NOT NULL              -- its lease end, as the record holds it
);
CREATE INDEX IF NOT EXISTS %[1]s_leases_idx ON %[1]s_leases (lease_until);
`, table)
}

// queries are the shared statements, those that start, move or end a lease
// keeping <table>_leases in step (see pgLeases), the reads of the records in
// progress through the leases' index, and the Reaper's DELETE.
func (postgresDialect) queries(table string) queries {
	q := sharedQueries(table)
	upsert := func(until string) string { return leaseUpsert(table, "rec", "$1", until) }

	// The claim's INSERT reads the row under the digest from the
	// statement's snapshot first and inserts only when there is none, so
	// that a claim of an existing record (a replay, a conflict) inserts
	// nothing: it locks nothing, takes no transaction ID, writes no WAL,
	// and never waits for a transaction that holds the row, as a bare ON
	// CONFLICT's check of the unique index would. It waits only for an
	// uncommitted INSERT of the same key, then does nothing.
	q.insert = pgLeases(fmt.Sprintf(`INSERT INTO %[1]s (%[2]s)
	SELECT %[3]s WHERE NOT EXISTS (SELECT 1 FROM %[1]s WHERE scope_hash = $1)
	ON CONFLICT (scope_hash) DO NOTHING
	RETURNING scope_hash`, table, insertCols, insertVals), upsert("$9"))
	takeover, restart := conditionalWin(table)
	q.takeover = pgLeases(takeover, upsert("$9"))
	q.restart = pgLeases(restart, upsert("$9"))
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
	return q
}

// pgLeases keeps <table>_leases (see schema) in step with the table: each
// statement that wins a record, moves its lease or ends it is a
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

// migrate creates the table or upgrades one of an earlier layout, in one
// transaction (see migrateTx): it gives the table its fillfactor, lists
// the records in progress in <table>_leases once, drops the earlier
// layouts' indexes, and turns a TEXT recovery_point into bytes.
func (d postgresDialect) migrate(ctx context.Context, s *Store) error {
	return s.migrateTx(ctx, func(tx *sql.Tx) error {
		if err := pgSetFillFactor(ctx, tx, s.table); err != nil {
			return err
		}
		if err := pgFillLeases(ctx, tx, s.table); err != nil {
			return err
		}
		// The earlier layouts' indexes go once the fill has read the
		// records in progress through the one that lists them, and before
		// a rewrite of the table would rebuild them: (state, lease_until)
		// and (updated_at), which every update but a heartbeat changed, and
		// the partial indexes whose predicate a completion changed.
		if err := dropIndexes(ctx, tx, s.table, "_lease_idx", "_updated_idx",
			"_pending_idx", "_done_idx"); err != nil {
			return err
		}
		return pgRecoveryPointAsBytes(ctx, tx, s.table)
	})
}

// leasesFilled is the comment of a table of the records in progress that
// Migrate has filled: Schema's DDL creates the table empty and unmarked,
// and Migrate fills it from the records once, whatever layout they were
// written in.
const leasesFilled = "sqlstore: lists the records in progress"

// pgFillLeases makes the table of the records in progress list exactly the
// records in progress, with their lease ends, unless it is marked as filled
// (leasesFilled): it adds the missing ones, corrects the lease ends,
// deletes the rows of records no longer in progress, and marks the table.
// No write can interleave: Schema's CREATE INDEX IF NOT EXISTS holds the
// records' table in SHARE mode until Migrate commits.
func pgFillLeases(ctx context.Context, tx *sql.Tx, table string) error {
	var marked bool
	if err := tx.QueryRowContext(ctx, `SELECT coalesce(obj_description(to_regclass($1), 'pg_class'), '') = $2`,
		table+"_leases", leasesFilled).Scan(&marked); err != nil || marked {
		return err
	}
	for _, stmt := range []string{
		`INSERT INTO ` + table + `_leases (scope_hash, lease_until)
SELECT scope_hash, lease_until FROM ` + table + ` WHERE state = 1
ON CONFLICT (scope_hash) DO UPDATE SET lease_until = EXCLUDED.lease_until
WHERE ` + table + `_leases.lease_until <> EXCLUDED.lease_until`,
		`DELETE FROM ` + table + `_leases l WHERE NOT EXISTS (SELECT 1 FROM ` + table + ` r
WHERE r.scope_hash = l.scope_hash AND r.state = 1)`,
		`COMMENT ON TABLE ` + table + `_leases IS '` + leasesFilled + `'`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

// pgSetFillFactor gives a table of an earlier layout the fillfactor of
// Schema's (it applies to the pages written from then on).
func pgSetFillFactor(ctx context.Context, tx *sql.Tx, table string) error {
	var opts string
	err := tx.QueryRowContext(ctx, `SELECT coalesce(array_to_string(reloptions, ','), '')
FROM pg_class WHERE oid = to_regclass($1)`, table).Scan(&opts)
	if err != nil || strings.Contains(","+opts+",", ",fillfactor="+fillFactor+",") {
		return err
	}
	_, err = tx.ExecContext(ctx, "ALTER TABLE "+table+" SET (fillfactor = "+fillFactor+")")
	return err
}

// pgRecoveryPointAsBytes turns a TEXT recovery_point into BYTEA, each value
// its UTF-8 bytes (what the Store wrote).
func pgRecoveryPointAsBytes(ctx context.Context, tx *sql.Tx, table string) error {
	var typ string
	err := tx.QueryRowContext(ctx, `SELECT format_type(atttypid, atttypmod) FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attname = 'recovery_point' AND NOT attisdropped`,
		table).Scan(&typ)
	if err != nil || typ == "bytea" {
		return err
	}
	_, err = tx.ExecContext(ctx, `ALTER TABLE `+table+`
	ALTER COLUMN recovery_point DROP DEFAULT,
	ALTER COLUMN recovery_point TYPE BYTEA USING convert_to(recovery_point, 'UTF8'),
	ALTER COLUMN recovery_point SET DEFAULT ''`)
	return err
}

// rebind keeps the $N placeholders.
func (postgresDialect) rebind(q string) string { return q }
