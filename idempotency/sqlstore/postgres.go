package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
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

// schema is the shared one (see schema), with BYTEA columns.
func (postgresDialect) schema(table string) string { return schema(table, "BYTEA") }

// queries are the shared statements, the claim's INSERT, the win's
// conditional UPDATEs and the Reaper's DELETE.
func (postgresDialect) queries(table string) queries {
	q := sharedQueries(table)

	// The claim's INSERT reads the row under the digest from the
	// statement's snapshot first and inserts only when there is none, so
	// that a claim of an existing record (a replay, a conflict) inserts
	// nothing: it locks nothing, takes no transaction ID, writes no WAL,
	// and never waits for a transaction that holds the row, as a bare ON
	// CONFLICT's check of the unique index would. It waits only for an
	// uncommitted INSERT of the same key, then does nothing.
	q.insert = fmt.Sprintf(`INSERT INTO %[1]s (%[2]s)
SELECT %[3]s WHERE NOT EXISTS (SELECT 1 FROM %[1]s WHERE scope_hash = $1)
ON CONFLICT (scope_hash) DO NOTHING`, table, insertCols, insertVals)
	q.takeover, q.restart = conditionalWin(table)

	// The claim in one transaction sets the transaction's lock_timeout to
	// $13 before its INSERT may wait for another transaction's uncommitted
	// row of the key, and resets it (to the session's startup value, as
	// RESET does) once it inserted, for the handler's statements: one
	// round trip. A claim that inserts nothing ends its transaction.
	q.insertWait = fmt.Sprintf(`INSERT INTO %[1]s (%[2]s)
SELECT %[3]s WHERE set_config('lock_timeout', $13, true) <> ''
	AND NOT EXISTS (SELECT 1 FROM %[1]s WHERE scope_hash = $1)
ON CONFLICT (scope_hash) DO NOTHING
RETURNING set_config('lock_timeout', NULL, true)`, table, insertCols, insertVals)

	// The subqueries lock their rows and skip the ones a running write
	// holds (FOR UPDATE SKIP LOCKED): the reaper never waits for a claim,
	// and a claim waiting for a row the reaper locked inserts afresh once
	// it is gone.
	q.deleteBefore = deleteBefore(table, " FOR UPDATE SKIP LOCKED")
	return q
}

// migrate creates the table or upgrades one of an earlier layout, in one
// transaction (see migrateTx): it drops the earlier layouts' indexes and
// their table of the records in progress, <table>_leases, which the
// partial indexes replace, and turns a TEXT recovery_point into bytes.
func (postgresDialect) migrate(ctx context.Context, s *Store) error {
	return s.migrateTx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, "DROP TABLE IF EXISTS "+s.table+"_leases"); err != nil {
			return err
		}
		if err := dropIndexes(ctx, tx, s.table, "_lease_idx", "_updated_idx",
			"_created_idx"); err != nil {
			return err
		}
		return pgRecoveryPointAsBytes(ctx, tx, s.table)
	})
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

// claimInTx runs insertWait with wait, at least minClaimWait, as the
// lock_timeout: the timeout ends any lock wait of the INSERT, not only the
// one on another transaction's row of the key (the relation's extension
// lock, under many concurrent inserts, waits too), so a shorter one would
// answer a fresh key in progress.
func (postgresDialect) claimInTx(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim,
	wait time.Duration) (bool, error) {
	ms := min(max(wait, minClaimWait).Milliseconds(), math.MaxInt32)
	n, err := execRows(ctx, tx, s.q.insertWait,
		append(s.insertArgs(c), strconv.FormatInt(ms, 10)+"ms")...)
	return n == 1, err
}

// heldPastWait: SQLSTATE 55P03, lock_not_available (lock_timeout).
func (postgresDialect) heldPastWait(err error) bool {
	var se interface{ SQLState() string }
	return errors.As(err, &se) && se.SQLState() == "55P03"
}

// rebind keeps the $N placeholders.
func (postgresDialect) rebind(q string) string { return q }
