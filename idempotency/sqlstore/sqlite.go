package sqlstore

import "strings"

// SQLiteBusyTimeoutMillis is the busy_timeout that SQLiteDSN sets: how long a
// connection waits for the database's write lock before failing with
// SQLITE_BUSY.
const SQLiteBusyTimeoutMillis = 10000

// SQLiteDSN returns the recommended modernc.org/sqlite data source name for a
// database file at path:
//
//	file:<path>?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_pragma=foreign_keys(1)&_txlock=immediate
//
// WAL lets readers run beside the one writer; busy_timeout makes a writer
// wait for the lock instead of failing at once; _txlock=immediate makes every
// transaction BEGIN IMMEDIATE, taking the write lock up front so that a
// transaction that reads and then writes can never fail half-way with
// SQLITE_BUSY (the unit of work that Begin starts does exactly that);
// foreign_keys is on because SQLite leaves it off. Characters of path that
// are special in a URI ('%', '?', '#') are percent-escaped. The result is for
// sql.Open("sqlite", ...); other SQLite drivers spell their parameters
// differently.
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
// fail with SQLITE_BUSY and answer 503. The other settings cannot be read
// back from a connection; without _txlock=immediate a unit that reads before
// it writes can still fail with SQLITE_BUSY, so use this DSN.
func SQLiteDSN(path string) string {
	r := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23")
	return "file:" + r.Replace(path) +
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}
