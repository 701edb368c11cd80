package sqlstore_test

import (
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// Open identifies the database behind the pool and refuses a Dialect that
// does not match it, naming both: a SQLite pool declared Postgres, and a
// PostgreSQL pool declared SQLite. The matching declarations open.
func TestOpenRefusesAMismatchedDialect(t *testing.T) {
	for _, tc := range []struct {
		name            string
		open            func(testing.TB) *sql.DB
		declared, found sqlstore.Dialect
		says            string
	}{
		{"sqlite_declared_postgres", openSQLite, sqlstore.Postgres, sqlstore.SQLite, "SQLite"},
		{"postgres_declared_sqlite", openPG, sqlstore.SQLite, sqlstore.Postgres, "PostgreSQL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := tc.open(t)
			_, err := sqlstore.Open(db, tc.declared)
			var de *sqlstore.DialectError
			require.ErrorAs(t, err, &de)
			require.Equal(t, tc.declared, de.Declared)
			require.Equal(t, tc.found, de.Found)
			require.Contains(t, de.Server, tc.says)
			require.Contains(t, err.Error(), tc.declared.String())
			require.Contains(t, err.Error(), tc.found.String())

			s, err := sqlstore.Open(db, tc.found)
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			if tc.found == sqlstore.Postgres {
				require.Contains(t, s.Schema(), "scope_hash          BYTEA    NOT NULL PRIMARY KEY")
				require.Contains(t, s.Schema(), "recovery_point      BYTEA")
			}
		})
	}
}
