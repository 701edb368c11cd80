package sqlstore_test

import (
	"database/sql"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// v1Schema is the DDL of the TEXT-keyed layout, the earlier layout without
// the scope digest (%[1]s the table, %[2]s the blob type).
const v1Schema = `CREATE TABLE %[1]s (
	principal           TEXT     NOT NULL,
	method              TEXT     NOT NULL,
	route               TEXT     NOT NULL,
	idem_key            TEXT     NOT NULL,
	state               SMALLINT NOT NULL CHECK (state IN (1, 2)),
	fingerprint         TEXT     NOT NULL,
	fingerprint_version INTEGER  NOT NULL,
	owner               TEXT     NOT NULL,
	generation          BIGINT   NOT NULL,
	lease_until         BIGINT   NOT NULL,
	recovery_point      TEXT     NOT NULL DEFAULT '',
	recovery_data       %[2]s,
	request             %[2]s,
	response_status     INTEGER,
	response_header     TEXT,
	response_body       %[2]s,
	created_at          BIGINT   NOT NULL,
	updated_at          BIGINT   NOT NULL,
	completed_at        BIGINT   NOT NULL DEFAULT 0,
	PRIMARY KEY (principal, method, route, idem_key)
);
CREATE INDEX %[1]s_lease_idx ON %[1]s (state, lease_until);
CREATE INDEX %[1]s_updated_idx ON %[1]s (updated_at)`

// TestMigrateUpgradesTheTextKeyedLayout fills a table of the earlier layout
// with more records than one copy page (a completed one with a JSON header
// and a body, an in-progress one with a recovery point, and many more), runs
// Migrate, and checks that every record is found under its scope, that a
// replay and a takeover work on the copied records, and that the old table
// is kept as <table>_v1.
func TestMigrateUpgradesTheTextKeyedLayout(t *testing.T) {
	forEachUpgradable(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		db := b.open(t)
		blob := "BLOB"
		if b.dialect == sqlstore.Postgres {
			blob = "BYTEA"
		}
		for _, stmt := range strings.Split(fmt.Sprintf(v1Schema, sqlstore.DefaultTable, blob), ";") {
			_, err := db.Exec(stmt)
			require.NoError(t, err)
		}
		insert := `INSERT INTO ` + sqlstore.DefaultTable + ` VALUES ($1, 'POST', $2, $3, $4, 'fp', 1, 'owner-a', 3, $5, $6, $7, $8, $9, $10, $11, 100, 200, $12)`
		now := t0.UnixNano()
		mustExec := func(args ...any) {
			_, err := db.Exec(insert, args...)
			require.NoError(t, err)
		}
		mustExec("acct", "/pay", "k-done", 2, now, "", nil, []byte("req"), 201,
			`{"Content-Type":["application/json"],"X-Two":["a","b"]}`, []byte(`{"id":1}`), now)
		mustExec("acct", "/pay", "k-busy", 1, now-1, "charged", []byte("state"), []byte("req"), nil, nil, nil, 0)
		const many = 1203
		tx, err := db.Begin()
		require.NoError(t, err)
		for i := range many {
			_, err := tx.Exec(insert, fmt.Sprintf("p%04d", i%7), "/r", fmt.Sprintf("k%05d", i), 2, now, "", nil, nil, 200, `{}`, nil, now)
			require.NoError(t, err)
		}
		require.NoError(t, tx.Commit())

		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx))
		require.NoError(t, s.Migrate(ctx), "a second Migrate is a no-op")

		done, err := s.Get(ctx, idempotency.Scope{Principal: "acct", Method: "POST", Route: "/pay", Key: "k-done"})
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, done.State)
		require.Equal(t, int64(3), done.Generation)
		require.Equal(t, 201, done.Response.Status)
		require.Equal(t, []string{"a", "b"}, done.Response.Header.Values("X-Two"))
		require.Equal(t, `{"id":1}`, string(done.Response.Body))
		require.Equal(t, "req", string(done.Request))

		replay, won, err := claimed(s.Claim(ctx, claimAt(done.Scope, "B", "fp", t0)))
		require.NoError(t, err)
		require.False(t, won)
		require.Equal(t, 201, replay.Response.Status)

		busy := idempotency.Scope{Principal: "acct", Method: "POST", Route: "/pay", Key: "k-busy"}
		abandoned, err := s.Abandoned(ctx, t0, 10)
		require.NoError(t, err)
		require.Len(t, abandoned, 1, "the Completer finds the copied record in progress")
		require.Equal(t, busy, abandoned[0].Scope)
		taken, won, err := claimed(s.Claim(ctx, claimAt(busy, "B", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won, "the copied record's lease had expired")
		require.Equal(t, int64(4), taken.Generation)
		require.Equal(t, "charged", taken.RecoveryPoint)
		require.Equal(t, "state", string(taken.RecoveryData))

		for _, i := range []int{0, 499, 500, 1000, many - 1} {
			sc := idempotency.Scope{Principal: fmt.Sprintf("p%04d", i%7), Method: "POST", Route: "/r", Key: fmt.Sprintf("k%05d", i)}
			rec, err := s.Get(ctx, sc)
			require.NoError(t, err, "record %d", i)
			require.Equal(t, 200, rec.Response.Status)
			require.NotNil(t, rec.Response.Header)
		}
		require.Equal(t, many+2, count(t, db, `SELECT COUNT(*) FROM `+sqlstore.DefaultTable))
		require.Equal(t, many+2, count(t, db, `SELECT COUNT(*) FROM `+sqlstore.DefaultTable+`_v1`))
		require.Equal(t, []string{"idempotency_records_done_idx", "idempotency_records_pending_idx", "pkey"},
			indexesOf(t, db, b.dialect), "the new table has its two indexes")
	})
}

// TestMigrateTurnsATextRecoveryPointIntoBytes starts from the layout with
// recovery_point as TEXT (the scope-digest layout before recovery points
// were bytes), with records written through the Store: an in-progress one
// with a recovery point and a completed one. Migrate makes the column bytes
// on PostgreSQL (SQLite keeps any bytes in TEXT and needs nothing) and keeps
// every record; a server that starts after it replays, takes over with the
// recovery point, and stores a recovery point of any bytes.
func TestMigrateTurnsATextRecoveryPointIntoBytes(t *testing.T) {
	forEachUpgradable(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		var dsn string
		open := openSQLite
		if b.dialect == sqlstore.Postgres {
			dsn = pgSchemaDSN(t)
			open = func(t testing.TB) *sql.DB {
				db, err := sql.Open("pgx", dsn)
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
		}
		db := open(t)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		blob := "BLOB"
		if b.dialect == sqlstore.Postgres {
			blob = "BYTEA"
		}
		current := "recovery_point      " + blob + "    NOT NULL DEFAULT ''"
		require.Contains(t, s.Schema(), current)
		for _, stmt := range strings.Split(strings.Replace(s.Schema(), current, "recovery_point TEXT NOT NULL DEFAULT ''", 1), ";") {
			if strings.TrimSpace(stmt) != "" {
				_, err := db.Exec(stmt)
				require.NoError(t, err)
			}
		}

		busy, won, err := claimed(s.Claim(ctx, claimAt(scope("busy"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, s.SetRecoveryPoint(ctx, busy.Lease(), "charged", []byte("ch_1"), t0))
		done, won, err := claimed(s.Claim(ctx, claimAt(scope("done"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, s.Complete(ctx, done.Lease(), idempotency.Response{Status: 201, Body: []byte("ok")}, t0))

		require.NoError(t, s.Migrate(ctx))
		require.NoError(t, s.Migrate(ctx), "a second Migrate is a no-op")
		if b.dialect == sqlstore.Postgres { // a new server: a pool of its own
			db = open(t)
			s, err = sqlstore.Open(db, b.dialect)
			require.NoError(t, err)
			var typ string
			require.NoError(t, db.QueryRow(`SELECT data_type FROM information_schema.columns
				WHERE table_schema = current_schema() AND table_name = $1 AND column_name = 'recovery_point'`,
				sqlstore.DefaultTable).Scan(&typ))
			require.Equal(t, "bytea", typ)
		}

		replay, err := s.Claim(ctx, claimAt(scope("done"), "B", "fp", t0.Add(time.Second)))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimExisting, replay.Outcome)
		require.Equal(t, "ok", string(replay.Record.Response.Body))
		taken, err := s.Claim(ctx, claimAt(scope("busy"), "B", "fp", t0.Add(time.Minute)))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimTakenOver, taken.Outcome)
		require.Equal(t, "charged", taken.Record.RecoveryPoint)
		require.Equal(t, "ch_1", string(taken.Record.RecoveryData))
		const odd = "intent:\xff\x00"
		require.NoError(t, s.SetRecoveryPoint(ctx, taken.Record.Lease(), odd, nil, t0.Add(time.Minute)))
		got, err := s.Get(ctx, scope("busy"))
		require.NoError(t, err)
		require.Equal(t, odd, got.RecoveryPoint)
	})
}

// indexedSchema is the DDL of the scope-digest layout with indexes on
// (state, lease_until) and (updated_at), which every completion and every
// recovery point changed (%[1]s the table, %[2]s the blob type).
const indexedSchema = `CREATE TABLE %[1]s (
	scope_hash          %[2]s    NOT NULL PRIMARY KEY,
	principal           %[2]s    NOT NULL,
	method              %[2]s    NOT NULL,
	route               %[2]s    NOT NULL,
	idem_key            %[2]s    NOT NULL,
	state               SMALLINT NOT NULL CHECK (state IN (1, 2)),
	fingerprint         TEXT     NOT NULL,
	fingerprint_version INTEGER  NOT NULL,
	owner               TEXT     NOT NULL,
	generation          BIGINT   NOT NULL,
	lease_until         BIGINT   NOT NULL,
	recovery_point      %[2]s    NOT NULL DEFAULT '',
	recovery_data       %[2]s,
	request             %[2]s,
	response_status     INTEGER,
	response_header     %[2]s,
	response_body       %[2]s,
	created_at          BIGINT   NOT NULL,
	updated_at          BIGINT   NOT NULL,
	completed_at        BIGINT   NOT NULL DEFAULT 0
);
CREATE INDEX %[1]s_lease_idx ON %[1]s (state, lease_until);
CREATE INDEX %[1]s_updated_idx ON %[1]s (updated_at)`

// forEachUpgradable is forEach over the dialects that have an earlier
// layout: PostgreSQL and SQLite (the MySQL dialect has none;
// TestMySQLMigrateTwiceAndConcurrently covers its Migrate).
func forEachUpgradable(t *testing.T, f func(t *testing.T, b backend)) {
	for _, b := range backends {
		if b.dialect != sqlstore.MySQL {
			t.Run(b.name, func(t *testing.T) { f(t, b) })
		}
	}
}

// indexesOf lists the indexes of the store's table, by name (SQLite's
// automatic index of the primary key as "pkey").
func indexesOf(t *testing.T, db *sql.DB, d sqlstore.Dialect) []string {
	t.Helper()
	q := `SELECT CASE WHEN name LIKE 'sqlite_autoindex_%' THEN 'pkey' ELSE name END
FROM sqlite_master WHERE type = 'index' AND tbl_name = ? ORDER BY 1`
	if d == sqlstore.Postgres {
		q = `SELECT CASE WHEN indexname ~ '_pkey[0-9]*$' THEN 'pkey' ELSE indexname END FROM pg_indexes
WHERE schemaname = current_schema() AND tablename = $1 ORDER BY 1`
	}
	rows, err := db.Query(q, sqlstore.DefaultTable)
	require.NoError(t, err)
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		out = append(out, n)
	}
	require.NoError(t, rows.Err())
	return out
}

// leasesLayout is the layout whose records in progress PostgreSQL listed
// in a table of their own, <table>_leases, beside an index on created_at
// (%[1]s the table).
const leasesLayout = `;
CREATE INDEX %[1]s_created_idx ON %[1]s (created_at);
CREATE TABLE %[1]s_leases (scope_hash BYTEA NOT NULL PRIMARY KEY, lease_until BIGINT NOT NULL);
CREATE INDEX %[1]s_leases_idx ON %[1]s_leases (lease_until);
ALTER TABLE %[1]s SET (fillfactor = 80);
COMMENT ON TABLE %[1]s_leases IS 'sqlstore: lists the records in progress'`

// TestMigrateUpgradesTheIndexesInPlace fills a table of an earlier layout
// (indexed on (state, lease_until) and (updated_at); on PostgreSQL also the
// layout that listed the records in progress in <table>_leases, with an
// index on created_at) with records written through the Store (completed
// ones past and inside the cleanup horizon, one in progress with an expired
// lease and a recovery point, one live), runs Migrate twice, and checks
// that the table is the same (no copy), every record reads back as it was,
// the indexes are Schema's (and the table of leases is gone), and the
// background jobs and the claims work on it.
func TestMigrateUpgradesTheIndexesInPlace(t *testing.T) {
	forEachUpgradable(t, func(t *testing.T, b backend) {
		blob := "BLOB"
		if b.dialect == sqlstore.Postgres {
			blob = "BYTEA"
		}
		indexed := fmt.Sprintf(indexedSchema, sqlstore.DefaultTable, blob)
		t.Run("lease_and_updated", func(t *testing.T) {
			upgradeInPlace(t, b, indexed,
				[]string{"idempotency_records_lease_idx", "idempotency_records_updated_idx", "pkey"})
		})
		if b.dialect == sqlstore.Postgres {
			t.Run("leases", func(t *testing.T) {
				ddl := strings.Replace(indexed+fmt.Sprintf(leasesLayout, sqlstore.DefaultTable),
					"CREATE INDEX idempotency_records_lease_idx ON idempotency_records (state, lease_until);\n"+
						"CREATE INDEX idempotency_records_updated_idx ON idempotency_records (updated_at);", "", 1)
				upgradeInPlace(t, b, ddl, []string{"idempotency_records_created_idx", "pkey"})
			})
		}
	})
}

// upgradeInPlace is TestMigrateUpgradesTheIndexesInPlace for the layout ddl,
// whose indexes are indexes. The rows are the same in every layout; the
// leases of a layout with a table of them are left as they are (Migrate
// drops the table).
func upgradeInPlace(t *testing.T, b backend, ddl string, indexes []string) {
	ctx := t.Context()
	db := b.open(t)
	for _, stmt := range strings.Split(ddl, ";") {
		_, err := db.Exec(stmt)
		require.NoError(t, err)
	}
	require.Equal(t, indexes, indexesOf(t, db, b.dialect))
	s, err := sqlstore.Open(db, b.dialect)
	require.NoError(t, err)

	old, recent := t0, t0.Add(100*time.Hour)
	const many = 300
	var scopes []idempotency.Scope
	for i := range many {
		at := old
		if i%2 == 1 {
			at = recent
		}
		sc := scope(fmt.Sprintf("done-%03d", i))
		rec, won, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", at)))
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(sc.Key)}, at))
		scopes = append(scopes, sc)
	}
	stale, _, err := claimed(s.Claim(ctx, claimAt(scope("stale"), "A", "fp", recent)))
	require.NoError(t, err)
	require.NoError(t, s.SetRecoveryPoint(ctx, stale.Lease(), "charged", []byte("ch_1"), recent))
	live := recent.Add(time.Minute)
	_, _, err = claimed(s.Claim(ctx, claimAt(scope("live"), "A", "fp", live)))
	require.NoError(t, err)
	scopes = append(scopes, scope("stale"), scope("live"))
	before := map[idempotency.Scope]idempotency.Record{}
	for _, sc := range scopes {
		rec, err := s.Get(ctx, sc)
		require.NoError(t, err)
		before[sc] = rec
	}
	var oid string
	if b.dialect == sqlstore.Postgres {
		require.NoError(t, db.QueryRow(`SELECT $1::regclass::oid::text`, sqlstore.DefaultTable).Scan(&oid))
	}

	require.NoError(t, s.Migrate(ctx))
	require.NoError(t, s.Migrate(ctx), "a second Migrate changes nothing")

	require.Equal(t, []string{"idempotency_records_done_idx", "idempotency_records_pending_idx", "pkey"},
		indexesOf(t, db, b.dialect))
	if b.dialect == sqlstore.Postgres {
		var after string
		var leases sql.NullString
		require.NoError(t, db.QueryRow(`SELECT $1::regclass::oid::text, to_regclass($2)::text`,
			sqlstore.DefaultTable, sqlstore.DefaultTable+"_leases").Scan(&after, &leases))
		require.Equal(t, oid, after, "the same table, upgraded in place")
		require.False(t, leases.Valid, "the table of leases is dropped")
	}
	require.Equal(t, len(scopes), count(t, db, `SELECT COUNT(*) FROM `+sqlstore.DefaultTable))
	for _, sc := range scopes {
		rec, err := s.Get(ctx, sc)
		require.NoError(t, err)
		require.Equal(t, before[sc], rec, "record %q", sc.Key)
	}

	// The jobs and the claims on the upgraded table.
	now := live.Add(time.Second)
	abandoned, err := s.Abandoned(ctx, now, 10)
	require.NoError(t, err)
	require.Len(t, abandoned, 1)
	require.Equal(t, scope("stale"), abandoned[0].Scope)
	n, err := s.DeleteBefore(ctx, old.Add(time.Hour), 1000)
	require.NoError(t, err)
	require.Equal(t, many/2, n, "the completed records past the horizon")
	replay, err := s.Claim(ctx, claimAt(scope("done-001"), "B", "fp", now))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimExisting, replay.Outcome)
	require.Equal(t, "done-001", string(replay.Record.Response.Body))
	taken, err := s.Claim(ctx, claimAt(scope("stale"), "B", "fp", now))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimTakenOver, taken.Outcome)
	require.Equal(t, "charged", taken.Record.RecoveryPoint)
	busy, err := s.Claim(ctx, claimAt(scope("live"), "B", "fp", now))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimExisting, busy.Outcome)
}
