package sqlstore_test

import (
	"bytes"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// openPGDatabase creates a database of the test's own (dropped at cleanup)
// with an extension of the database (pg_walinspect, pgstattuple: created
// there and nowhere else), and returns a pool on it and its DSN.
func openPGDatabase(t testing.TB, extension string) (*sql.DB, string) {
	t.Helper()
	dsn := pgDSN(t)
	admin, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	name := "t_" + randHex(8)
	_, err = admin.Exec("CREATE DATABASE " + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)") })
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	u.Path = "/" + name
	db, err := sql.Open("pgx", u.String())
	require.NoError(t, err)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	_, err = db.Exec(`CREATE EXTENSION ` + extension)
	require.NoError(t, err)
	return db, u.String()
}

// walWatch reads the WAL records that touch some tables: their heaps, their
// TOAST tables and every index of these, by their file nodes in this
// database.
type walWatch struct {
	t     *testing.T
	db    *sql.DB
	nodes map[string]bool // "<database oid>/<relfilenode>"
	from  string          // the LSN the watch starts at
}

// watchWAL starts watching the WAL records of tables in db, a database of
// openPGDatabase with pg_walinspect created.
func watchWAL(t *testing.T, db *sql.DB, tables ...string) *walWatch {
	t.Helper()
	w := &walWatch{t: t, db: db, nodes: map[string]bool{}}
	for _, table := range tables {
		rows, err := db.Query(`SELECT (SELECT oid FROM pg_database WHERE datname = current_database())::text
	|| '/' || pg_relation_filenode(c.oid)::text
FROM pg_class c
WHERE c.oid IN ($1::regclass, (SELECT reltoastrelid FROM pg_class WHERE oid = $1::regclass))
   OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid IN
	($1::regclass, (SELECT reltoastrelid FROM pg_class WHERE oid = $1::regclass)))`, table)
		require.NoError(t, err)
		n := len(w.nodes)
		for rows.Next() {
			var node string
			require.NoError(t, rows.Scan(&node))
			w.nodes[node] = true
		}
		require.NoError(t, rows.Err())
		require.GreaterOrEqual(t, len(w.nodes)-n, 2, "%s: its heap and an index at least", table)
	}
	w.from = w.flushed()
	return w
}

// flushed commits a write to a table of its own, which flushes the WAL
// written before it (records of statements that took no transaction ID wait
// for a flush), and returns the flushed LSN.
func (w *walWatch) flushed() string {
	_, err := w.db.Exec(`CREATE TABLE IF NOT EXISTS wal_marker (n INTEGER); INSERT INTO wal_marker VALUES (1)`)
	require.NoError(w.t, err)
	var lsn string
	require.NoError(w.t, w.db.QueryRow(`SELECT pg_current_wal_flush_lsn()::text`).Scan(&lsn))
	return lsn
}

var blockRef = regexp.MustCompile(`rel \d+/(\d+/\d+) `)

// records returns the WAL records on the watched table written since the
// watch started (or the last call), as "resource_manager/record_type xid".
func (w *walWatch) records() []string {
	to := w.flushed()
	rows, err := w.db.Query(`SELECT resource_manager, record_type, xid::text, coalesce(block_ref, '')
FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)`, w.from, to)
	require.NoError(w.t, err)
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var rm, typ, xid, ref string
		require.NoError(w.t, rows.Scan(&rm, &typ, &xid, &ref))
		for _, m := range blockRef.FindAllStringSubmatch(ref, -1) {
			if w.nodes[m[1]] {
				out = append(out, rm+"/"+typ+" xid "+xid)
				break
			}
		}
	}
	require.NoError(w.t, rows.Err())
	w.from = to
	return out
}

// A replay (a claim that finds the record completed) and an in-progress
// conflict (a claim that finds a live lease) are reads on PostgreSQL: their
// statement takes no transaction ID and writes no WAL record on the store's
// table, its TOAST table or any of their indexes, as Store.Get. Measured
// per relation (pg_walinspect over the table's file nodes) and per
// transaction (pg_current_xact_id_if_assigned), so that other sessions'
// writes to the same server count for nothing. A fresh claim, the control,
// does write.
func TestPostgresReplayAndConflictWriteNothing(t *testing.T) {
	ctx := t.Context()
	db, _ := openPGDatabase(t, "pg_walinspect")
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx))

	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<14) // 256 KiB: kept in the TOAST table
	done, won, err := claimed(s.Claim(ctx, claimAt(scope("done"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	require.NoError(t, s.Complete(ctx, done.Lease(), idempotency.Response{Status: 201, Body: body}, t0))
	_, won, err = claimed(s.Claim(ctx, claimAt(scope("busy"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)
	// No dead row versions left for a read to prune: what follows is only
	// what the claims themselves write.
	_, err = db.Exec(`VACUUM ` + sqlstore.DefaultTable)
	require.NoError(t, err)

	w := watchWAL(t, db, sqlstore.DefaultTable)
	later := t0.Add(time.Second)
	for range 5 {
		res, err := s.Claim(ctx, claimAt(scope("done"), "B", "fp", later))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimExisting, res.Outcome)
		require.Equal(t, idempotency.Completed, res.Record.State)
		require.True(t, bytes.Equal(body, res.Record.Response.Body))
		res, err = s.Claim(ctx, claimAt(scope("busy"), "B", "fp", later))
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimExisting, res.Outcome)
		require.Equal(t, "A", res.Record.Owner)
		_, err = s.Get(ctx, scope("done"))
		require.NoError(t, err)
	}
	require.Empty(t, w.records(), "replays and conflicts wrote WAL on the store's tables")

	for _, key := range []string{"done", "busy"} {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		require.NoError(t, err)
		rec, err := sqlstore.ClaimIn(ctx, s, tx, claimAt(scope(key), "B", "fp", later))
		require.NoError(t, err)
		require.Equal(t, "A", rec.Owner)
		var xid sql.NullString
		require.NoError(t, tx.QueryRow(`SELECT pg_current_xact_id_if_assigned()::text`).Scan(&xid))
		require.NoError(t, tx.Rollback())
		require.False(t, xid.Valid, "the claim of %q took transaction ID %s", key, xid.String)
	}

	_, won, err = claimed(s.Claim(ctx, claimAt(scope("fresh"), "B", "fp", later)))
	require.NoError(t, err)
	require.True(t, won)
	require.NotEmpty(t, w.records(), "the control: a fresh claim writes its row")
}

// On SQLite a replay or an in-progress conflict commits no page: the WAL
// file does not grow (checkpointed to empty first). What remains on SQLite
// is the write lock: the claim statement is an upsert, so it waits for a
// writer that holds the lock, as any write does.
func TestSQLiteReplayAndConflictWriteNothing(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	require.NoError(t, err)
	db.SetMaxOpenConns(4)
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlstore.Open(db, sqlstore.SQLite)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx))
	done, _, err := claimed(s.Claim(ctx, claimAt(scope("done"), "A", "fp", t0)))
	require.NoError(t, err)
	require.NoError(t, s.Complete(ctx, done.Lease(), idempotency.Response{Status: 201, Body: []byte("ok")}, t0))
	_, _, err = claimed(s.Claim(ctx, claimAt(scope("busy"), "A", "fp", t0)))
	require.NoError(t, err)

	walSize := func() int64 {
		fi, err := os.Stat(path + "-wal")
		require.NoError(t, err)
		return fi.Size()
	}
	var busy, logged, moved int
	require.NoError(t, db.QueryRow(`PRAGMA wal_checkpoint(TRUNCATE)`).Scan(&busy, &logged, &moved))
	require.Zero(t, busy)
	require.Zero(t, walSize())
	later := t0.Add(time.Second)
	for i := range 5 {
		res, err := s.Claim(ctx, claimAt(scope("done"), "B"+strconv.Itoa(i), "fp", later))
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, res.Record.State)
		res, err = s.Claim(ctx, claimAt(scope("busy"), "B"+strconv.Itoa(i), "fp", later))
		require.NoError(t, err)
		require.Equal(t, "A", res.Record.Owner)
	}
	require.Zero(t, walSize(), "replays and conflicts appended to the WAL")
	_, won, err := claimed(s.Claim(ctx, claimAt(scope("fresh"), "B", "fp", later)))
	require.NoError(t, err)
	require.True(t, won)
	require.NotZero(t, walSize(), fmt.Sprintf("the control: a fresh claim appends to the WAL (%s)", path))
}

// walKinds counts WAL records by resource manager and type, without the
// record's flags ("INSERT+INIT" is an INSERT) and transaction ID.
func walKinds(recs []string) map[string]int {
	out := map[string]int{}
	for _, r := range recs {
		kind, _, _ := strings.Cut(r, " xid ")
		kind, _, _ = strings.Cut(kind, "+")
		out[kind]++
	}
	return out
}

// The work a request with a fresh key asks of PostgreSQL, read from the WAL
// records on the store's relations and from the table's statistics: the
// claim inserts a row and two index entries (the primary key, the records
// in progress); the completion, which changes the state the partial
// indexes select on, writes a new row version and two index entries (the
// primary key, the completed records); a recovery point is a HOT update
// (it changes no indexed column: no index entry, the new row version on
// the old one's page, which has room here).
func TestPostgresIndexWritesPerRequest(t *testing.T) {
	ctx := t.Context()
	db, dsn := openPGDatabase(t, "pg_walinspect")
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx))

	const n = 20
	claim := func(key string) idempotency.Record {
		rec, won, err := claimed(s.Claim(ctx, claimAt(scope(key), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		return rec
	}
	complete := func(rec idempotency.Record) {
		require.NoError(t, s.Complete(ctx, rec.Lease(),
			idempotency.Response{Status: 201, Body: []byte("ok")}, t0.Add(2*time.Millisecond)))
	}
	complete(claim("first")) // every index has its root page
	w := watchWAL(t, db, sqlstore.DefaultTable)
	for i := range n {
		complete(claim(fmt.Sprint("k", i)))
	}
	kinds := walKinds(w.records())
	require.Equal(t, n, kinds["Heap/INSERT"], "claims in %v", kinds)
	require.Equal(t, n, kinds["Heap/UPDATE"], "completions in %v", kinds)
	require.Zero(t, kinds["Heap/HOT_UPDATE"], "completions in %v", kinds)
	require.Equal(t, 4*n, kinds["Btree/INSERT_LEAF"], "index entries in %v", kinds)

	// A recovery point on a page with room: no index entry.
	_, err = db.Exec(`VACUUM ` + sqlstore.DefaultTable) // the dead versions' room, free again
	require.NoError(t, err)
	rec := claim("phased")
	w.records()
	require.NoError(t, s.SetRecoveryPoint(ctx, rec.Lease(), "order", []byte("o"), t0.Add(time.Millisecond)))
	kinds = walKinds(w.records())
	require.Equal(t, map[string]int{"Heap/HOT_UPDATE": 1}, kinds)

	// The statistics agree once the backends that ran the statements have
	// reported them (a backend reports at its exit at the latest).
	require.NoError(t, db.Close())
	stats, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = stats.Close() })
	var upd, hot int64
	require.Eventually(t, func() bool {
		require.NoError(t, stats.QueryRow(`SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE relid = $1::regclass`, sqlstore.DefaultTable).Scan(&upd, &hot))
		return upd >= n+2
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, int64(n+2), upd)
	require.Equal(t, int64(1), hot, "the recovery point's update is HOT, no completion is")
}
