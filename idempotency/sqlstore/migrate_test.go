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
		var idx int
		q := `SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = '` + sqlstore.DefaultTable + `' AND name LIKE '%_idx'`
		// SQLite's two partial indexes; PostgreSQL's on created_at and on the leases.
		if b.dialect == sqlstore.Postgres {
			q = `SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename IN ('` +
				sqlstore.DefaultTable + `', '` + sqlstore.DefaultTable + `_leases') AND indexname LIKE '%_idx'`
		}
		require.NoError(t, db.QueryRow(q).Scan(&idx))
		require.Equal(t, 2, idx, "the new table has its two indexes")
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
		q = `SELECT CASE WHEN indexname LIKE '%_pkey' THEN 'pkey' ELSE indexname END FROM pg_indexes
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

// partialIndexes are the indexes of the layout before PostgreSQL's table of
// the records in progress: partial indexes whose predicate, the state, a
// completion changed (%[1]s the table).
const partialIndexes = `;
CREATE INDEX %[1]s_pending_idx ON %[1]s (lease_until) WHERE state = 1;
CREATE INDEX %[1]s_done_idx ON %[1]s (completed_at) WHERE state = 2`

// TestMigrateUpgradesTheIndexesInPlace fills a table of an earlier layout
// (indexed on (state, lease_until) and (updated_at), and on PostgreSQL also
// the partial indexes on the state) with records written through the Store
// (completed ones past and inside the cleanup horizon, one in progress with
// an expired lease and a recovery point, one live), runs Migrate twice, and
// checks that the table is the same (no copy), every record reads back as
// it was, the indexes are Schema's (and on PostgreSQL the fillfactor is set
// and the table of the records in progress lists the two in progress), and
// the background jobs and the claims work on it.
func TestMigrateUpgradesTheIndexesInPlace(t *testing.T) {
	forEachUpgradable(t, func(t *testing.T, b backend) {
		blob := "BLOB"
		if b.dialect == sqlstore.Postgres {
			blob = "BYTEA"
		}
		t.Run("lease_and_updated", func(t *testing.T) {
			upgradeInPlace(t, b, fmt.Sprintf(indexedSchema, sqlstore.DefaultTable, blob),
				[]string{"idempotency_records_lease_idx", "idempotency_records_updated_idx", "pkey"}, false)
		})
		if b.dialect == sqlstore.Postgres {
			t.Run("partial", func(t *testing.T) {
				ddl := strings.Replace(fmt.Sprintf(indexedSchema, sqlstore.DefaultTable, blob)+
					fmt.Sprintf(partialIndexes, sqlstore.DefaultTable),
					"CREATE INDEX idempotency_records_lease_idx ON idempotency_records (state, lease_until);\n"+
						"CREATE INDEX idempotency_records_updated_idx ON idempotency_records (updated_at);", "", 1)
				upgradeInPlace(t, b, ddl, []string{"idempotency_records_done_idx",
					"idempotency_records_pending_idx", "pkey"}, false)
			})
			// The operator ran Schema's DDL before Migrate, as the package
			// documentation suggests for a large table: the leases' table
			// exists, lists none of the records in progress, and holds a
			// row of no record.
			t.Run("partial_leases_created_first", func(t *testing.T) {
				ddl := strings.Replace(fmt.Sprintf(indexedSchema, sqlstore.DefaultTable, blob)+
					fmt.Sprintf(partialIndexes, sqlstore.DefaultTable),
					"CREATE INDEX idempotency_records_lease_idx ON idempotency_records (state, lease_until);\n"+
						"CREATE INDEX idempotency_records_updated_idx ON idempotency_records (updated_at);", "", 1)
				upgradeInPlace(t, b, ddl, []string{"idempotency_records_done_idx",
					"idempotency_records_pending_idx", "pkey"}, true)
			})
		}
	})
}

// upgradeInPlace is TestMigrateUpgradesTheIndexesInPlace for the layout ddl,
// whose indexes are indexes. The rows are the same in every layout: on
// PostgreSQL, the Store writes the leases of the records in progress to a
// table that is dropped before Migrate, so that the table is as an earlier
// server left it; with leasesFirst, the leases' table stays, with the
// live record's lease missing, a wrong lease end for the stale one and a
// row of no record.
func upgradeInPlace(t *testing.T, b backend, ddl string, indexes []string, leasesFirst bool) {
	ctx := t.Context()
	db := b.open(t)
	for _, stmt := range strings.Split(ddl, ";") {
		_, err := db.Exec(stmt)
		require.NoError(t, err)
	}
	require.Equal(t, indexes, indexesOf(t, db, b.dialect))
	leases := sqlstore.DefaultTable + "_leases"
	if b.dialect == sqlstore.Postgres {
		_, err := db.Exec(`CREATE TABLE ` + leases + ` (scope_hash BYTEA PRIMARY KEY, lease_until BIGINT NOT NULL)`)
		require.NoError(t, err)
	}
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

	switch {
	case b.dialect == sqlstore.Postgres && leasesFirst:
		for _, stmt := range []string{
			`DELETE FROM ` + leases + ` WHERE scope_hash = (SELECT scope_hash FROM ` + sqlstore.DefaultTable +
				` WHERE idem_key = 'live'::bytea)`, // missing
			`UPDATE ` + leases + ` SET lease_until = 1`,     // the stale one's, wrong
			`INSERT INTO ` + leases + ` VALUES ('\x00', 1)`, // of no record
		} {
			_, err := db.Exec(stmt)
			require.NoError(t, err)
		}
	case b.dialect == sqlstore.Postgres:
		_, err := db.Exec(`DROP TABLE ` + leases)
		require.NoError(t, err)
	}
	require.NoError(t, s.Migrate(ctx))
	require.NoError(t, s.Migrate(ctx), "a second Migrate changes nothing")

	want := []string{"idempotency_records_done_idx", "idempotency_records_pending_idx", "pkey"}
	if b.dialect == sqlstore.Postgres {
		want = []string{"idempotency_records_created_idx", "pkey"}
		var listed []string
		rows, err := db.Query(`SELECT encode(l.scope_hash, 'hex') || ' ' || (l.lease_until = r.lease_until)::text
FROM ` + leases + ` l JOIN ` + sqlstore.DefaultTable + ` r USING (scope_hash) WHERE r.state = 1 ORDER BY r.idem_key`)
		require.NoError(t, err)
		for rows.Next() {
			var v string
			require.NoError(t, rows.Scan(&v))
			listed = append(listed, v[strings.IndexByte(v, ' ')+1:])
		}
		require.NoError(t, rows.Err())
		require.NoError(t, rows.Close())
		require.Equal(t, []string{"true", "true"}, listed, "the live and the stale record, with their lease ends")
		require.Equal(t, 2, count(t, db, `SELECT COUNT(*) FROM `+leases), "only the records in progress")

		// Migrate fills the list once: on a filled table it reads no
		// record, so a row added to the list stays.
		_, err = db.Exec(`INSERT INTO ` + leases + ` VALUES ('\x01', 1)`)
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx))
		require.Equal(t, 3, count(t, db, `SELECT COUNT(*) FROM `+leases))
		_, err = db.Exec(`DELETE FROM ` + leases + ` WHERE scope_hash = '\x01'`)
		require.NoError(t, err)
	}
	require.Equal(t, want, indexesOf(t, db, b.dialect))
	if b.dialect == sqlstore.Postgres {
		var after, opts string
		require.NoError(t, db.QueryRow(`SELECT oid::text, array_to_string(reloptions, ',') FROM pg_class
WHERE oid = $1::regclass`, sqlstore.DefaultTable).Scan(&after, &opts))
		require.Equal(t, oid, after, "the same table, upgraded in place")
		require.Equal(t, "fillfactor=80", opts)
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
