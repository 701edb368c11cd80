// Package sqlstore keeps idempotency records in a relational database through
// database/sql: PostgreSQL or MySQL/MariaDB for a fleet of servers sharing
// one store, SQLite for an embedded store in one process. Its Store
// implements idempotency.Store and idempotency.Transactor. Beside the
// standard library it imports package idempotency only, and no SQL driver:
// bring your own (tested with github.com/jackc/pgx/v5/stdlib, driver "pgx",
// modernc.org/sqlite, driver "sqlite", and github.com/go-sql-driver/mysql,
// driver "mysql"):
//
//	db, err := sql.Open("pgx", dsn) // or sql.Open("sqlite", sqlstore.SQLiteDSN(path)),
//	                                // or sql.Open("mysql", dsn)
//	store, err := sqlstore.Open(db, sqlstore.Postgres) // or sqlstore.SQLite, sqlstore.MySQL
//	err = store.Migrate(ctx)        // creates the table or upgrades an old one
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//
// # Schema
//
// Migrate runs the DDL that Store.Schema returns (or run it with your own
// migration tool). For PostgreSQL and the default table:
//
//	CREATE TABLE IF NOT EXISTS idempotency_records (
//		scope_hash          BYTEA    NOT NULL PRIMARY KEY, -- SHA-256 of the scope parts
//		principal           BYTEA    NOT NULL,
//		method              BYTEA    NOT NULL,
//		route               BYTEA    NOT NULL,
//		idem_key            BYTEA    NOT NULL,
//		state               SMALLINT NOT NULL CHECK (state IN (1, 2)), -- 1 in progress, 2 completed
//		fingerprint         TEXT     NOT NULL,
//		fingerprint_version INTEGER  NOT NULL,
//		owner               TEXT     NOT NULL,
//		generation          BIGINT   NOT NULL,
//		lease_until         BIGINT   NOT NULL, -- Unix nanoseconds, UTC
//		recovery_point      BYTEA    NOT NULL DEFAULT '',
//		recovery_data       BYTEA,
//		request             BYTEA,
//		response_status     INTEGER,
//		response_header     BYTEA,            -- length-prefixed names and values, byte for byte
//		response_body       BYTEA,
//		created_at          BIGINT   NOT NULL,
//		updated_at          BIGINT   NOT NULL,
//		completed_at        BIGINT   NOT NULL DEFAULT 0 -- 0 until completed
//	);
//	CREATE INDEX IF NOT EXISTS idempotency_records_pending_idx
//		ON idempotency_records (lease_until) WHERE state = 1;
//	CREATE INDEX IF NOT EXISTS idempotency_records_done_idx
//		ON idempotency_records (completed_at) WHERE state = 2;
//
// The two partial indexes serve the background jobs and nothing else: the
// records in progress by lease end (the Completer's Abandoned, the Reaper's
// unfinished records) and the completed records by completion time (the
// Reaper's deletes). A record is in one of them at a time, so a claim adds
// two index entries (the primary key's and the first index's) and a
// completion two (the primary key's and the second's): on PostgreSQL a
// completion writes a new row version whose old one, with its index
// entries, autovacuum removes, and a recovery point is a HOT update (no
// index entry) when its page has room. SQLite's table is the same with
// BLOB for BYTEA. MySQL's is in "MySQL and MariaDB" below. Times are the
// callers' times as integer nanoseconds, never a database clock.
// Principal, method, route, key and recovery point are bytes of any
// length, and a replay returns the stored status, headers and body byte
// for byte. The primary key is, in PostgreSQL 11 or later terms,
//
//	sha256(int8send(octet_length(principal)) || principal ||
//	       int8send(octet_length(method)) || method ||
//	       int8send(octet_length(route)) || route ||
//	       int8send(octet_length(idem_key)) || idem_key)
//
// On PostgreSQL and SQLite, Migrate also brings a table of an earlier layout
// to this one, in one transaction: a table keyed on the TEXT scope parts is
// renamed to <table>_v1 (drop it once you no longer need it) and its records
// are copied into a new table; on PostgreSQL a TEXT recovery_point becomes
// BYTEA in place (the table is locked and rewritten); the indexes of earlier
// layouts, on (state, lease_until) and (updated_at) and on PostgreSQL on
// created_at, are replaced in place by Schema's (writes to the table wait
// while they are built, and on PostgreSQL reads too once an old index is
// dropped, until Migrate commits; on a large table, build them first with
// CREATE INDEX CONCURRENTLY under Schema's names); and on PostgreSQL the
// earlier layout's list of the records in progress, <table>_leases, is
// dropped. Run it from one process before the servers serve, and stop the
// servers of the earlier version first: they write to what Migrate drops.
// A connection that prepared a statement before the change fails it once.
//
// # Claims and fences
//
// A claim wins an existing row only if the row holds the claim's own scope
// parts (a digest collision never overwrites another scope's record) and
// either completed before the replay window (it restarts the record as a
// fresh one, ClaimCreated) or holds an expired lease with the same
// fingerprint (it takes the record over, ClaimTakenOver, keeping its
// recovery point). Which of the two happened is the statement's, never
// read off the row's times afterwards. Every later write (heartbeat,
// recovery point, completion, release) is conditional on owner, generation
// and the in-progress state, and returns idempotency.ErrLeaseLost when it
// changed nothing.
//
// A claim is at most three steps, the same on every dialect. An INSERT
// creates the record when the scope has none, and otherwise does nothing:
// a fresh key costs this one statement. When the key exists, a plain read
// fetches the record to answer from: a replay or an in-progress conflict
// is two statements and writes nothing. Only when that record is one the
// claim wins (an expired lease with the same fingerprint, a completion
// before the replay window) does a third step win it, a conditional UPDATE
// (on MySQL a short locking transaction, below); a takeover and a restart
// are three statements. If the record changes between these steps so that
// the claim is undecided (it was released or reaped, or another claim won
// it), the claim starts over, at most three rounds: every answer is the
// record as one statement saw it, never a record the claim would have won.
//
// On PostgreSQL the INSERT reads the key from its snapshot and inserts
// only when it finds none, so that a replay or a conflict locks nothing,
// takes no transaction ID, writes no WAL and never waits for another
// transaction (it answers the record as last committed; a bare ON CONFLICT
// DO NOTHING would wait for any transaction that holds the record's row,
// such as a unit whose completion is written but not yet committed). Only
// a claim that would win waits for a row another transaction holds, and
// re-checks the row's latest version. On SQLite the INSERT is a plain ON
// CONFLICT DO NOTHING: a replay or a conflict changes no page (the WAL does
// not grow), but takes the database's write lock for the statement, as
// every SQLite write does, so it waits for a writer that holds it. MySQL's
// claim is below ("MySQL and MariaDB").
//
// Statements per guarded request, beyond the handler's own: a fresh key is
// two, the claim and the completion (in the handler's transaction when it
// asked for one, with its BEGIN and COMMIT); a replay or an in-progress
// conflict two, the claim's INSERT and its read.
//
// # Transactions
//
// Store.Begin starts a unit of work whose context leads to its *sql.Tx; a
// handler gets it with Tx(r.Context()) and writes its business rows in it,
// so that they commit or roll back together with the stored response.
// Inside an atomic phase, Tx returns the phase's own transaction. The
// transaction begins at the first Tx call: a unit that never needs one
// (a phase that writes nothing through Tx) holds no connection while its
// work runs, and writes its record with one stand-alone statement at
// Commit. Between its own statements in a transaction the Store waits for
// nothing (no lock, no other connection, no timer): a connection idle in a
// transaction waits for the handler, or for its goroutine to run.
//
// The fences assume READ COMMITTED on PostgreSQL, so a unit's transaction
// is begun READ COMMITTED whatever the server's default. Under a default of
// REPEATABLE READ or SERIALIZABLE, a stand-alone statement that meets a
// serialization failure (SQLSTATE 40001) or a deadlock (40P01) is run again,
// up to three times; one that still fails, or one inside a unit, is an
// *OpError matching ErrSerialization: nothing committed and the lease is
// still the caller's.
//
// # One transaction per request
//
// A Middleware made with idempotency.WithOneTransaction(true) claims a
// fresh key with Store.ClaimInUnit: BEGIN, then the claim's INSERT in
// that transaction; Tx gives the handler the same transaction; the
// completion's UPDATE and the COMMIT end it. The claim, the handler's
// writes and the response commit at once: one commit per request where
// the ordinary path makes two (the claim's, then the unit's). Through
// database/sql, BEGIN and COMMIT are round trips of their own, so the
// library sends 4 statements around the handler's on PostgreSQL and
// SQLite (BEGIN, INSERT, UPDATE, COMMIT), 6 on MySQL (the claim's lock
// wait is set and restored around its INSERT); a replay is 4 (BEGIN, the
// INSERT that inserts nothing, the read, ROLLBACK) where the ordinary path
// sends 2.
//
// Until the COMMIT no other connection sees the record, so nothing
// reads it in progress and nothing can take it over: the lease is the
// transaction's, and no heartbeat runs. A claim of the same key waits for
// the transaction (on PostgreSQL and MySQL at most WithMaxInProgressWait,
// never less than a second, see ClaimInUnit; on SQLite, whose
// transactions take the database's write lock at BEGIN, up to the busy
// timeout), then replays, or runs when the first rolled back; it holds a
// connection of the pool while it waits, and the middleware ends the wait
// when the request's context ends. On MySQL a claim whose lock wait could
// not be restored (canceled between the two) closes its connection rather
// than give it back to the pool with the claim's setting. A crash, a
// killed connection, an error or a panic of the handler rolls the claim
// back with the handler's writes: there is nothing to resume and nothing
// for the Completer. Keep handlers with phases or External calls, which
// need committed recovery points, on a Middleware without the option.
//
// # Clocks
//
// The Store never reads a clock. A takeover compares the lease end written
// by one server with another server's time, so the servers sharing a
// database need clocks that agree to well below the lease (NTP): a server
// whose clock runs ahead takes over a live lease early (the fence then
// stops the old owner's writes, but two executions overlapped).
//
// # MySQL and MariaDB
//
// The MySQL dialect runs on MySQL 8.0 or later and MariaDB 10.6 or later
// (tested on MariaDB 10.11), with InnoDB tables, in the SQL both servers
// share: MySQL has no RETURNING, MariaDB's INSERT has one and its UPDATE
// none, so no statement relies on it. Open identifies the server by
// @@version. The table (Migrate runs Schema, one CREATE TABLE IF NOT EXISTS:
// this is the MySQL dialect's only layout):
//
//	CREATE TABLE IF NOT EXISTS idempotency_records (
//		scope_hash          BINARY(32) NOT NULL PRIMARY KEY,
//		principal, method, route, idem_key, fingerprint, owner, recovery_point
//		                    LONGBLOB   NOT NULL,
//		recovery_data, request, response_header, response_body LONGBLOB,
//		... the integer columns as above ...,
//		INDEX idempotency_records_pending_idx (state, lease_until),
//		INDEX idempotency_records_done_idx (state, completed_at)
//	) ENGINE = InnoDB
//
// Every string is a LONGBLOB, compared byte for byte (a TEXT column would
// compare under a collation that folds case). The primary key is
// UNHEX(SHA2(CONCAT(UNHEX(LPAD(HEX(LENGTH(principal)), 16, '0')),
// principal, ... idem_key), 256)), the same digest as above. MySQL has no
// partial index, so the two indexes put the state first: (state,
// lease_until) finds the records in progress by lease end (the Completer,
// the Reaper's unfinished records), (state, completed_at) the completed
// ones by completion time (the Reaper's deletes), each as a range of its
// index in the order the job reads. Every record has an entry in both, so
// a claim adds three index entries and a completion moves two; a recovery
// point changes none (updated_at, which it sets, is indexed nowhere), a
// heartbeat one. InnoDB has no per-table fill factor: an update that fits
// rewrites the row in place.
//
// A claim is one INSERT, which creates the record or fails on the
// duplicate key; when it fails, one plain read gets the record to answer
// from (a replay or a 409: two statements, nothing written). Only a claim
// whose read shows a record it would win (an expired lease, or a completed
// record past the replay window) runs a short transaction that locks the
// row (SELECT ... FOR UPDATE), decides again on what it locked and updates
// it, fenced on the generation: a takeover is BEGIN, read, UPDATE, COMMIT
// after the first two. An ON DUPLICATE KEY UPDATE has no WHERE, its
// IF()-per-column form depends on the order assignments are evaluated in
// (MariaDB's SIMULTANEOUS_ASSIGNMENT mode changes it), and it cannot
// report what it did without a second statement anyway.
//
// MySQL reports the rows an UPDATE changed, not those it matched: a
// heartbeat or recovery point that changes nothing is followed by a
// locking read that tells whether the lease still holds, so the Store
// works with and without the driver's clientFoundRows. It prepares its
// stand-alone statements once per connection (one round trip each; a unit
// that never began its transaction writes its record with one of them);
// statements inside a unit's transaction run unprepared, one round trip
// with the driver's interpolateParams=true, two without (prepare and
// execute), so set interpolateParams=true in the DSN. parseTime and multiStatements
// play no part (times are integers; one statement per call).
//
// Isolation: the Store needs no particular level. Its fences are
// conditional UPDATEs and locking reads, which InnoDB runs on each row's
// latest committed version at every level, and a unit's transaction runs
// at the session's level (REPEATABLE READ by default; the tests run READ
// COMMITTED, REPEATABLE READ and SERIALIZABLE). REPEATABLE READ and
// SERIALIZABLE also lock gaps of the indexes a statement searches, and
// concurrent claims of one key deadlock in InnoDB where two checked the key
// for duplicates behind a DELETE of its record: a stand-alone statement
// that fails with a deadlock (1213) or a lock wait timeout (1205) is run
// again, up to three times; one that still fails, or one inside a unit, is
// an *OpError matching ErrSerialization (the middleware answers 503; the
// client retries). The Reaper's DeleteBefore reads its candidates with a
// plain SELECT and deletes them by primary key, so it locks rows in the
// same order as every other write and never deadlocks with a unit; unlike
// PostgreSQL's, it waits for a row that a running write holds.
//
// In a unit, a failed statement does not end a MySQL transaction, and a
// deadlock rolls it back whole, after which statements on the same
// *sql.Tx run and commit one by one: a handler must stop at its first
// failed write (return a 5xx), as the middleware then rolls the unit back
// and gives the key up. Business tables must be InnoDB to commit with the
// record. A response body or recovery data larger than the server's
// max_allowed_packet cannot be stored (the store answers 503): raise it, or
// the middleware's WithMaxStoredBody below it.
//
// # PostgreSQL through pgx's native pool
//
// An application that holds a *pgxpool.Pool gives the Store a *sql.DB over
// it with stdlib.OpenDBFromPool(pool); close that *sql.DB before the pool.
//
// # SQLite
//
// Open SQLite with SQLiteDSN and keep more than one open connection; Open
// refuses a database without a busy timeout or with deferred transactions.
// One writer at a time holds SQLite's lock: a unit of work holds it from its
// first Tx call to its commit, and other requests' writes (claims, replays
// and in-progress conflicts too, whose claim is an upsert) wait for it up to
// the busy timeout, then fail with 503. Keep
// transactional handlers short on SQLite, or use PostgreSQL, which locks
// only the record's row. Several processes on one host may share the file.
//
// # Cleanup
//
// The claim path never deletes records: run the idempotency package's
// Reaper over the store. Its DELETE is bounded (the Reaper yields between
// batches), finds its rows through the indexes of the completed records
// and of the records in progress (see "Schema"), re-checks the horizon on
// every row, and on PostgreSQL skips rows that a running write holds (on
// MySQL it waits for them).
package sqlstore
