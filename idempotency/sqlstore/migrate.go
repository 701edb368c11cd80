package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

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
	return opErr("migrate", s.d.migrate(ctx, s))
}

// migrateTx is Migrate on PostgreSQL and SQLite, in one transaction: it
// renames a table of the TEXT-keyed layout to <table>_v1, runs Schema's
// statements, copies the v1 records into the new table, runs the dialect's
// upgrade steps, and commits.
func (s *Store) migrateTx(ctx context.Context, upgrade func(*sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	old := s.table + "_v1"
	v1, err := s.hasV1Layout(ctx, tx)
	if err != nil {
		return err
	}
	var stmts []string
	if v1 {
		stmts = append(stmts, "ALTER TABLE "+s.table+" RENAME TO "+old)
	}
	stmts = append(stmts, splitStatements(s.Schema())...)
	for _, stmt := range stmts {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	if v1 {
		if err := s.copyV1(ctx, tx, old); err != nil {
			return fmt.Errorf("copying the records of %s: %w", old, err)
		}
	}
	if err := upgrade(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// dropIndexes drops the indexes named table followed by each suffix, where
// they exist: those of earlier layouts.
func dropIndexes(ctx context.Context, tx *sql.Tx, table string, suffixes ...string) error {
	for _, suffix := range suffixes {
		if _, err := tx.ExecContext(ctx, "DROP INDEX IF EXISTS "+table+suffix); err != nil {
			return err
		}
	}
	return nil
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
	next := s.d.rebind(fmt.Sprintf(`SELECT %[2]s FROM %[1]s
WHERE (principal, method, route, idem_key) > ($1, $2, $3, $4)
ORDER BY principal, method, route, idem_key LIMIT %[3]d`, old, columns, v1Page))
	insert := s.d.rebind(fmt.Sprintf(`INSERT INTO %[1]s (scope_hash, %[2]s)
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
