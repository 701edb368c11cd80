package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/headercodec"
)

// Migrate creates the table and its indexes if they do not exist, and
// upgrades a table of an earlier layout (see the package documentation,
// "Schema"), all in one transaction. A second run changes nothing. Run it
// from one process: concurrent first runs may race on the catalog and fail
// (never losing a record; run it again). Errors are *OpError with Op
// "migrate".
func (s *Store) Migrate(ctx context.Context) error {
	if s.dialect == MySQL {
		return s.mysqlMigrate(ctx)
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return opErr("migrate", err)
	}
	defer func() { _ = tx.Rollback() }()
	old := s.table + "_v1"
	v1, err := s.hasV1Layout(ctx, tx)
	if err != nil {
		return opErr("migrate", err)
	}
	var stmts []string
	if v1 {
		stmts = append(stmts, "ALTER TABLE "+s.table+" RENAME TO "+old)
	}
	stmts = append(stmts, splitStatements(s.Schema())...)
	for _, stmt := range stmts {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return opErr("migrate", err)
		}
	}
	if err := s.setFillFactor(ctx, tx); err != nil {
		return opErr("migrate", err)
	}
	if v1 {
		if err := s.copyV1(ctx, tx, old); err != nil {
			return opErr("migrate", fmt.Errorf("copying the records of %s: %w", old, err))
		}
	}
	if err := s.fillLeases(ctx, tx); err != nil {
		return opErr("migrate", err)
	}
	// The earlier layouts' indexes go once the fill has read the records in
	// progress through the one that lists them, and before a rewrite of the
	// table would rebuild them.
	for _, idx := range oldIndexes(s.dialect, s.table) {
		if _, err := tx.ExecContext(ctx, "DROP INDEX IF EXISTS "+idx); err != nil {
			return opErr("migrate", err)
		}
	}
	if err := s.recoveryPointAsBytes(ctx, tx); err != nil {
		return opErr("migrate", err)
	}
	return opErr("migrate", tx.Commit())
}

// leasesFilled is the comment of a PostgreSQL table of the records in
// progress that Migrate has filled: Schema's DDL creates the table empty
// and unmarked, and Migrate fills it from the records once, whatever
// layout they were written in.
const leasesFilled = "sqlstore: lists the records in progress"

// fillLeases makes PostgreSQL's table of the records in progress list
// exactly the records in progress, with their lease ends, unless it is
// marked as filled (leasesFilled): it adds the missing ones, corrects the
// lease ends, deletes the rows of records no longer in progress, and marks
// the table. No write can interleave: Schema's CREATE INDEX IF NOT EXISTS
// holds the records' table in SHARE mode until Migrate commits. Nothing on
// SQLite and MySQL, which have no such table.
func (s *Store) fillLeases(ctx context.Context, tx *sql.Tx) error {
	if s.dialect != Postgres {
		return nil
	}
	var marked bool
	if err := tx.QueryRowContext(ctx, `SELECT coalesce(obj_description(to_regclass($1), 'pg_class'), '') = $2`,
		s.table+"_leases", leasesFilled).Scan(&marked); err != nil || marked {
		return err
	}
	for _, stmt := range []string{
		`INSERT INTO ` + s.table + `_leases (scope_hash, lease_until)
SELECT scope_hash, lease_until FROM ` + s.table + ` WHERE state = 1
ON CONFLICT (scope_hash) DO UPDATE SET lease_until = EXCLUDED.lease_until
WHERE ` + s.table + `_leases.lease_until <> EXCLUDED.lease_until`,
		`DELETE FROM ` + s.table + `_leases l WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` r
WHERE r.scope_hash = l.scope_hash AND r.state = 1)`,
		`COMMENT ON TABLE ` + s.table + `_leases IS '` + leasesFilled + `'`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

// setFillFactor gives a PostgreSQL table of an earlier layout the
// fillfactor of Schema's (it applies to the pages written from then on).
func (s *Store) setFillFactor(ctx context.Context, tx *sql.Tx) error {
	if s.dialect != Postgres {
		return nil
	}
	var opts string
	err := tx.QueryRowContext(ctx, `SELECT coalesce(array_to_string(reloptions, ','), '')
FROM pg_class WHERE oid = to_regclass($1)`, s.table).Scan(&opts)
	if err != nil || strings.Contains(","+opts+",", ",fillfactor="+fillFactor+",") {
		return err
	}
	_, err = tx.ExecContext(ctx, "ALTER TABLE "+s.table+" SET (fillfactor = "+fillFactor+")")
	return err
}

// recoveryPointAsBytes turns a PostgreSQL table's TEXT recovery_point into
// BYTEA, each value its UTF-8 bytes (what the Store wrote). SQLite keeps any
// bytes in a TEXT column as they were: it needs nothing.
func (s *Store) recoveryPointAsBytes(ctx context.Context, tx *sql.Tx) error {
	if s.dialect != Postgres {
		return nil
	}
	var typ string
	err := tx.QueryRowContext(ctx, `SELECT format_type(atttypid, atttypmod) FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attname = 'recovery_point' AND NOT attisdropped`,
		s.table).Scan(&typ)
	if err != nil || typ == "bytea" {
		return err
	}
	_, err = tx.ExecContext(ctx, `ALTER TABLE `+s.table+`
	ALTER COLUMN recovery_point DROP DEFAULT,
	ALTER COLUMN recovery_point TYPE BYTEA USING convert_to(recovery_point, 'UTF8'),
	ALTER COLUMN recovery_point SET DEFAULT ''`)
	return err
}

// hasV1Layout reports whether the Store's table exists without the
// scope_hash column. Each probe runs under a savepoint, so that its failure
// does not end the transaction (PostgreSQL aborts a transaction at its
// first error).
func (s *Store) hasV1Layout(ctx context.Context, tx *sql.Tx) (bool, error) {
	probe := func(col string) (bool, error) {
		if _, err := tx.ExecContext(ctx, "SAVEPOINT sqlstore_probe"); err != nil {
			return false, err
		}
		_, qerr := tx.ExecContext(ctx, "SELECT "+col+" FROM "+s.table+" WHERE 1 = 0")
		if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT sqlstore_probe"); err != nil {
			return false, err
		}
		_, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT sqlstore_probe")
		return qerr == nil, err
	}
	exists, err := probe("principal")
	if err != nil || !exists {
		return false, err
	}
	current, err := probe("scope_hash")
	return !current, err
}

// v1Page is how many records copyV1 reads per statement.
const v1Page = 500

// copyV1 copies every record of the v1-layout table old into the Store's
// table, page by page in primary-key order.
func (s *Store) copyV1(ctx context.Context, tx *sql.Tx, old string) error {
	first := fmt.Sprintf(`SELECT %[2]s FROM %[1]s
ORDER BY principal, method, route, idem_key LIMIT %[3]d`, old, columns, v1Page)
	next := s.dialect.rebind(fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE (principal, method, route, idem_key) > ($1, $2, $3, $4)
ORDER BY principal, method, route, idem_key LIMIT %[3]d`, old, columns, v1Page))
	insert := s.dialect.rebind(fmt.Sprintf(`INSERT INTO %[1]s (scope_hash, %[2]s)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)
ON CONFLICT (scope_hash) DO NOTHING`, s.table, columns))
	var last []any
	for {
		var (
			rows *sql.Rows
			err  error
		)
		if last == nil {
			rows, err = tx.QueryContext(ctx, first)
		} else {
			rows, err = tx.QueryContext(ctx, next, last...)
		}
		if err != nil {
			return err
		}
		var page [][]any
		for rows.Next() {
			vals, err := scanV1(rows)
			if err != nil {
				_ = rows.Close()
				return err
			}
			page = append(page, vals)
		}
		if err := rows.Close(); err != nil {
			return err
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for _, vals := range page {
			if _, err := tx.ExecContext(ctx, insert, vals...); err != nil {
				return err
			}
		}
		if len(page) < v1Page {
			return nil
		}
		// The keyset: the last row's TEXT parts, as the old table holds them.
		p := page[len(page)-1]
		last = []any{string(p[1].([]byte)), string(p[2].([]byte)), string(p[3].([]byte)),
			string(p[4].([]byte))}
	}
}

// scanV1 reads one v1 record and returns the values to insert into the
// current layout: the digest, the parts as bytes, the header re-encoded.
func scanV1(rows *sql.Rows) ([]any, error) {
	var (
		principal, method, route, key            string
		state, fpVersion, generation, leaseUntil int64
		fingerprint, owner, point                string
		recoveryData, request, body              []byte
		status                                   sql.NullInt64
		header                                   sql.NullString
		created, updated, completed              int64
	)
	if err := rows.Scan(&principal, &method, &route, &key, &state, &fingerprint, &fpVersion,
		&owner, &generation, &leaseUntil, &point, &recoveryData, &request, &status, &header,
		&body, &created, &updated, &completed); err != nil {
		return nil, err
	}
	var h http.Header
	if header.Valid {
		h = http.Header{}
		if err := json.Unmarshal([]byte(header.String), &h); err != nil {
			return nil, errors.Join(headercodec.ErrMalformed, err)
		}
	}
	var st any
	if status.Valid {
		st = status.Int64
	}
	sc := idempotency.Scope{Principal: principal, Method: method, Route: route, Key: key}
	return []any{scopeHash(sc), []byte(principal), []byte(method), []byte(route), []byte(key),
		state, fingerprint, fpVersion, owner, generation, leaseUntil, []byte(point),
		nullBytes(recoveryData), nullBytes(request), st, nullBytes(headercodec.Encode(h)),
		nullBytes(body), created, updated, completed}, nil
}
