// Package sqlstore keeps idempotency records in a relational database through
// database/sql: PostgreSQL for a fleet of servers sharing one store, SQLite
// for an embedded store in one process. Its Store implements
// idempotency.Store and idempotency.Transactor. Beside the standard library
// it imports package idempotency only, and no SQL driver: bring your own
// (tested with github.com/jackc/pgx/v5/stdlib, driver "pgx", and
// modernc.org/sqlite, driver "sqlite"):
//
//	db, err := sql.Open("pgx", dsn)      // or sql.Open("sqlite", sqlstore.SQLiteDSN(path))
//	store, err := sqlstore.Open(db, sqlstore.Postgres) // or sqlstore.SQLite
//	err = store.Migrate(ctx)             // creates the table or upgrades an old one
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
//	) WITH (fillfactor = 80);
//	CREATE INDEX IF NOT EXISTS idempotency_records_pending_idx
//		ON idempotency_records (lease_until) WHERE state = 1;
//	CREATE INDEX IF NOT EXISTS idempotency_records_done_idx
//		ON idempotency_records (completed_at) WHERE state = 2;
//
// SQLite's is the same with BLOB for BYTEA and without the fillfactor. The
// two partial indexes are the only ones beside the primary key, one for
// each background job: records in progress by lease end (the Completer and
// the Reaper's list of unfinished records) and completed records by
// completion time (the Reaper's deletes). A claim adds two index entries, a
// completion two; a recovery point changes no indexed column (on
// PostgreSQL a HOT update, kept on its page by the fillfactor). A
// completion is not a HOT update: the state it changes is the indexes'
// predicate. Times are the callers' times as
// integer nanoseconds, never a database clock. Principal, method, route, key
// and recovery point are bytes of any length, and a replay returns the
// stored status, headers and body byte for byte. The primary key is, in
// PostgreSQL 11 or later terms,
//
//	sha256(int8send(octet_length(principal)) || principal ||
//	       int8send(octet_length(method)) || method ||
//	       int8send(octet_length(route)) || route ||
//	       int8send(octet_length(idem_key)) || idem_key)
//
// Migrate upgrades the layouts of earlier releases in one transaction: a table
// keyed on the TEXT scope parts is renamed to <table>_v1 (drop it once you no
// longer need it) and its records are copied into a new table; on PostgreSQL a
// TEXT recovery_point becomes BYTEA in place (the table is locked and
// rewritten); the indexes on (state, lease_until) and (updated_at) are
// replaced in place by the two partial indexes (writes to the table wait while
// they are built; on a large table, build them first with CREATE INDEX
// CONCURRENTLY under Schema's names), and on PostgreSQL the table gets its
// fillfactor, for the pages written from then on. Run it from one process
// before this release's servers serve. A connection that prepared a statement
// before the change fails it once. Servers of the previous release keep
// working on the upgraded table (a recovery point containing a backslash is
// refused to them); servers of the TEXT-keyed release fail closed (503).
//
// # Claims and fences
//
// A claim is one statement that wins an existing row only if the row holds
// the claim's own scope parts (a digest collision never overwrites another
// scope's record) and either completed before the replay window or holds
// an expired lease with the same fingerprint. Every later write (heartbeat,
// recovery point, completion, release) is conditional on owner, generation
// and the in-progress state, and returns idempotency.ErrLeaseLost when it
// changed nothing.
//
// On PostgreSQL the claim reads before it writes, in the same statement: a
// replay or an in-progress conflict is a plain read of the statement's
// snapshot, which locks nothing, takes no transaction ID, writes no WAL and
// never waits for another transaction (it answers the record as last
// committed). Only a claim that would win waits for a row another
// transaction holds, and re-checks the row's latest version. On SQLite the
// claim is an upsert whose condition keeps the row unless the claim wins: a
// replay or a conflict changes no page (the WAL does not grow), but takes
// the database's write lock for the statement, as every SQLite write does,
// so it waits for a writer that holds it.
//
// Statements per guarded request, beyond the handler's own: a fresh key is
// two, the claim and the completion (in the handler's transaction when it
// asked for one, with its BEGIN and COMMIT). A replay or an in-progress
// conflict is one statement on PostgreSQL, which returns the existing
// record; on SQLite two, since SQLite's RETURNING reports only rows a
// statement wrote: the claim, which changes nothing, and a read. A claim
// that loses a race with a row committed after its statement began reads
// the record once more (at most three rounds).
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
// # Clocks
//
// The Store never reads a clock. A takeover compares the lease end written
// by one server with another server's time, so the servers sharing a
// database need clocks that agree to well below the lease (NTP): a server
// whose clock runs ahead takes over a live lease early (the fence then
// stops the old owner's writes, but two executions overlapped).
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
// batches), finds its rows through the two partial indexes, re-checks the
// horizon on every row, and on PostgreSQL skips rows that a running write
// holds.
package sqlstore
