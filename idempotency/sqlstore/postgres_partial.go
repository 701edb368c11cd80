package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
)

// postgresPartial is PostgreSQL with SQLite's layout: no list of leases,
// the records in progress and the completed ones in two partial indexes
// (a completion is no HOT update).
type postgresPartial struct{ postgresDialect }

func (postgresPartial) schema(table string) string {
	return fmt.Sprintf(schemaFmt, table, "BYTEA", "") + fmt.Sprintf(`;
CREATE INDEX IF NOT EXISTS %[1]s_pending_idx ON %[1]s (lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS %[1]s_done_idx ON %[1]s (completed_at) WHERE state = 2;
`, table)
}

func (postgresPartial) queries(table string) queries {
	q := sharedQueries(table)
	q.insert = fmt.Sprintf(`INSERT INTO %[1]s (%[2]s)
	SELECT %[3]s WHERE NOT EXISTS (SELECT 1 FROM %[1]s WHERE scope_hash = $1)
	ON CONFLICT (scope_hash) DO NOTHING`, table, insertCols, insertVals)
	q.takeover, q.restart = conditionalWin(table)
	q.deleteBefore = fmt.Sprintf(`DELETE FROM %[1]s WHERE scope_hash IN (
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 2 AND completed_at < $1 AND updated_at < $1
		ORDER BY completed_at LIMIT $2 FOR UPDATE SKIP LOCKED) done
	UNION ALL
	SELECT scope_hash FROM (SELECT scope_hash FROM %[1]s
		WHERE state = 1 AND lease_until < $1 AND updated_at < $1
		ORDER BY lease_until LIMIT $2 FOR UPDATE SKIP LOCKED) unfinished
	LIMIT $2)
  AND updated_at < $1 AND (state = 2 OR lease_until < $1)`, table)
	return q
}

func (postgresPartial) migrate(ctx context.Context, s *Store) error {
	return s.migrateTx(ctx, func(*sql.Tx) error { return nil })
}
