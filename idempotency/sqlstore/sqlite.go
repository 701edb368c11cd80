package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// sqliteDialect is SQLite's: its SQL, the checks of the pool Open makes,
// and the steps that upgrade a table of an earlier layout.
type sqliteDialect struct{ returning }

func (sqliteDialect) name() string { return "sqlite" }

// identify reads sqlite_version(), which only SQLite answers.
func (sqliteDialect) identify(ctx context.Context, db *sql.DB) (bool, string, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT sqlite_version()").Scan(&v); err != nil {
		return false, "", err
	}
	return true, "SQLite " + v, nil
}

func (sqliteDialect) check(ctx context.Context, db *sql.DB) error { return checkSQLite(ctx, db) }

// prepared is true: SQLite parses a statement on every unprepared call, and
// the claim's parse cost more than the rest of the request.
func (sqliteDialect) prepared() bool { return true }

// txOptions are nil: SQLite transactions are serializable anyway (one
// writer at a time), and the modernc.org/sqlite driver ignores the
// isolation level.
func (sqliteDialect) txOptions() *sql.TxOptions { return nil }

// schema is the shared one (see schema), with BLOB columns.
func (sqliteDialect) schema(table string) string { return schema(table, "BLOB") }

// queries are the shared statements, the claim's plain INSERT, the win's
// conditional UPDATEs and the Reaper's DELETE (SQLite serialises writers,
// so no row changes under it), in SQLite's numbered ?N placeholders.
func (d sqliteDialect) queries(table string) queries {
	q := sharedQueries(table)
	q.insert = fmt.Sprintf(`INSERT INTO %[1]s (%[2]s) VALUES (%[3]s)
ON CONFLICT (scope_hash) DO NOTHING`, table, insertCols, insertVals)
	q.takeover, q.restart = conditionalWin(table)
	q.deleteBefore = deleteBefore(table, "")
	q.rebind(d.rebind)
	return q
}

// claimInTx runs the claim's INSERT: the transaction began IMMEDIATE, so
// it holds the database's write lock, for which it waited up to the busy
// timeout whatever wait is; no other transaction holds a row.
func (d sqliteDialect) claimInTx(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim,
	_ time.Duration) (bool, error) {
	return d.claim(ctx, s, tx, c)
}

// heldPastWait is false: a write lock not had within the busy timeout is
// SQLITE_BUSY, a failure of the store, whichever key its holder claimed.
func (sqliteDialect) heldPastWait(error) bool { return false }

// rebind turns $N into SQLite's numbered ?N.
func (sqliteDialect) rebind(q string) string { return strings.ReplaceAll(q, "$", "?") }

// migrate creates the table or upgrades one of an earlier layout, in one
// transaction (see migrateTx), and drops the earlier layouts' indexes on
// (state, lease_until) and (updated_at), which every update but a
// heartbeat changed. SQLite keeps any bytes in a TEXT column as they were:
// a TEXT recovery_point needs nothing.
func (sqliteDialect) migrate(ctx context.Context, s *Store) error {
	return s.migrateTx(ctx, func(tx *sql.Tx) error {
		return dropIndexes(ctx, tx, s.table, "_lease_idx", "_updated_idx")
	})
}

// SQLiteBusyTimeoutMillis is the busy_timeout that SQLiteDSN sets: how long a
// connection waits for the database's write lock before failing with
// SQLITE_BUSY.
const SQLiteBusyTimeoutMillis = 10000

// SQLiteDSN returns the recommended modernc.org/sqlite data source name for a
// database file at path:
//
//	file:<path>?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)
//		&_pragma=synchronous(NORMAL)&_pragma=foreign_keys(1)&_txlock=immediate
//
// (one line, without the break and the indent). WAL lets readers run beside
// the one writer; busy_timeout makes a writer wait for the lock instead of
// failing at once; _txlock=immediate makes every transaction BEGIN IMMEDIATE,
// taking the write lock up front so that a transaction that reads and then
// writes can never fail half-way with SQLITE_BUSY (the unit of work that Begin
// starts does exactly that); foreign_keys is on because SQLite leaves it off.
// Characters of path that are special in a URI ('%', '?', '#') are
// percent-escaped. The result is for sql.Open("sqlite", ...); other SQLite
// drivers spell their parameters differently.
//
// Keep several open connections (database/sql's default is unlimited; a
// small number such as 4 to 8 via db.SetMaxOpenConns is plenty): with
// db.SetMaxOpenConns(1), a handler that holds the unit's transaction while
// anything else (a heartbeat, a second request) needs a connection waits for
// the whole request. SQLite admits one writer at a time however many
// connections there are: requests that write serialise on the lock, up to
// the busy timeout.
//
// Open refuses a SQLite database whose busy timeout is under
// MinSQLiteBusyTimeoutMillis (ErrSQLiteBusyTimeout): sql.Open("sqlite",
// "keys.db") has none, and under concurrent requests a share of them would
// fail with SQLITE_BUSY and answer 503. It also refuses one whose
// transactions begin deferred (ErrSQLiteDeferredTx, no _txlock=immediate):
// a unit that reads before it writes would fail with SQLITE_BUSY as soon as
// another connection writes. Use this DSN.
func SQLiteDSN(path string) string {
	r := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23")
	return "file:" + r.Replace(path) + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)" +
		"&_pragma=synchronous(NORMAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}

// checkSQLite refuses a SQLite pool whose connections would fail under
// concurrent writers: one without a busy timeout, or whose transactions do
// not take the write lock when they begin. A PRAGMA run through the *sql.DB
// reaches one connection only, so it checks every connection the pool has
// open plus a new one, made from the DSN as every later one is; and it
// begins a transaction on one of them while another tries BEGIN IMMEDIATE
// without waiting, which succeeds only if the first began deferred.
func checkSQLite(ctx context.Context, db *sql.DB) error {
	st := db.Stats()
	n := max(st.OpenConnections+1, 2) // and two for the lock check
	if st.MaxOpenConnections > 0 {
		n = min(n, st.MaxOpenConnections)
	}
	conns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			return opErr("open", err)
		}
		conns = append(conns, c)
		var ms int64
		if err := c.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&ms); err != nil {
			return opErr("open", err)
		}
		if ms < MinSQLiteBusyTimeoutMillis {
			return fmt.Errorf("%w (busy_timeout is %d ms on a connection of the pool, at least %d)",
				ErrSQLiteBusyTimeout, ms, MinSQLiteBusyTimeoutMillis)
		}
	}
	if len(conns) < 2 {
		return nil // one connection: its transactions cannot meet another's in this process
	}
	return checkImmediate(ctx, conns[0], conns[1])
}

// checkImmediate begins a transaction on a as a unit does, then tries
// BEGIN IMMEDIATE on b without waiting: b gets the write lock only if a's
// transaction began deferred (ErrSQLiteDeferredTx). b's busy timeout is
// restored after.
func checkImmediate(ctx context.Context, a, b *sql.Conn) error {
	var ms int64
	if err := b.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&ms); err != nil {
		return opErr("open", err)
	}
	tx, err := a.BeginTx(ctx, nil)
	if err != nil {
		return opErr("open", err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := b.ExecContext(ctx, "PRAGMA busy_timeout = 0"); err != nil {
		return opErr("open", err)
	}
	restore := "PRAGMA busy_timeout = " + strconv.FormatInt(ms, 10)
	defer func() { _, _ = b.ExecContext(context.Background(), restore) }()
	if _, err := b.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return nil // a holds the write lock: its transactions begin immediate
	}
	_, _ = b.ExecContext(context.Background(), "ROLLBACK")
	return ErrSQLiteDeferredTx
}
