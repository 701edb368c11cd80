// Package sqlstore keeps idempotency records in a relational database through
// database/sql: PostgreSQL for a fleet of servers sharing one store, SQLite
// for an embedded store in one process. It implements idempotency.Store and
// idempotency.Transactor.
//
// The package imports only database/sql; bring your own driver. It is tested
// with github.com/jackc/pgx/v5/stdlib (driver "pgx") and modernc.org/sqlite
// (driver "sqlite", pure Go):
//
//	db, err := sql.Open("pgx", "postgres://app@db/app")   // or sql.Open("sqlite", sqlstore.SQLiteDSN("idem.db"))
//	store, err := sqlstore.Open(db, sqlstore.Postgres)     // or sqlstore.SQLite
//	err = store.Migrate(ctx)                               // CREATE TABLE IF NOT EXISTS ... (and upgrades an older layout)
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//
// # Schema
//
// Schema creation is explicit: Migrate runs the DDL that Store.Schema
// returns, or you run it with your own migration tool. For PostgreSQL and
// the default table it is:
//
//	CREATE TABLE IF NOT EXISTS idempotency_records (
//		scope_hash          BYTEA    NOT NULL PRIMARY KEY, -- SHA-256 of the length-prefixed scope parts
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
//		recovery_point      TEXT     NOT NULL DEFAULT '',
//		recovery_data       BYTEA,
//		request             BYTEA,
//		response_status     INTEGER,
//		response_header     BYTEA,            -- length-prefixed names and values, byte for byte
//		response_body       BYTEA,
//		created_at          BIGINT   NOT NULL,
//		updated_at          BIGINT   NOT NULL,
//		completed_at        BIGINT   NOT NULL DEFAULT 0 -- 0 until completed
//	);
//	CREATE INDEX IF NOT EXISTS idempotency_records_lease_idx ON idempotency_records (state, lease_until);
//	CREATE INDEX IF NOT EXISTS idempotency_records_updated_idx ON idempotency_records (updated_at);
//
// SQLite's is the same with BLOB for BYTEA. Times are integer nanoseconds
// since the Unix epoch in both dialects, so every comparison is exact and
// never depends on a database clock or time zone: the store uses only the
// times its callers pass.
//
// Any bytes of any length work as a principal, method, route or key (a path
// such as /pay/%ff, /pay/%00 or a 4000-byte segment, used as the route): the
// primary key is the SHA-256 of the four parts, each preceded by its length
// as an 8-byte big-endian integer, and the parts themselves are kept as
// bytes, never as TEXT (PostgreSQL refuses invalid UTF-8 and NUL in TEXT, and
// B-tree index rows over 2704 bytes). On PostgreSQL 11 or later the key of a
// row is
//
//	sha256(int8send(octet_length(principal)) || principal || int8send(octet_length(method)) || method ||
//	       int8send(octet_length(route)) || route || int8send(octet_length(idem_key)) || idem_key)
//
// A stored response is replayed byte for byte: status, every allow-listed
// header value (invalid UTF-8 included: a Latin-1 file name in
// Content-Disposition stays as it was) and the body.
//
// # Upgrading from the TEXT-keyed layout
//
// Releases before the scope digest keyed the table on (principal, method,
// route, idem_key) as TEXT and stored the response header as JSON. Migrate
// upgrades such a table in one transaction: it renames it to <table>_v1,
// drops its two indexes, creates the new table and copies every record into
// it (digest computed, header re-encoded; in-progress records keep their
// owner, generation, lease and recovery point). Drop <table>_v1 yourself once
// you no longer need it. The copy is one INSERT per record, inside the
// transaction that holds the renamed table, so its time grows with the
// records kept (up to the cleanup horizon's worth); run Migrate from one
// process. Servers of the earlier release that still use the
// table fail closed from then on (503, never an unguarded run); a request
// that such a server had claimed and not yet completed stays in progress
// until its lease expires, and its retry then takes it over. So upgrade all
// servers of a fleet together, or accept a few 503s and retries during the
// roll-out. If you otherwise run the DDL with your own tool, run Migrate
// once for this upgrade; or rename the old table and its indexes, create the
// new one, and accept that the old records are not replayed (a retry of a
// request completed before the upgrade then runs again).
//
// # Claims and fences
//
// A claim is one statement, never a read followed by a write, and the same
// statement returns the record to answer from when the claim loses. On
// PostgreSQL:
//
//	WITH claimed AS (
//		INSERT ... VALUES (...)
//		ON CONFLICT (scope_hash) DO UPDATE SET ...
//		WHERE (completed AND completed_at < now - replay window)
//		   OR (in progress AND lease_until < now AND fingerprint = excluded.fingerprint)
//		RETURNING ...)
//	SELECT ... FROM claimed
//	UNION ALL
//	SELECT ... FROM table WHERE scope_hash = $1 AND NOT EXISTS (SELECT 1 FROM claimed)
//
// SQLite has no data-modifying CTE, so its DO UPDATE keeps every column as
// it is unless the same condition holds, and RETURNING returns the row
// either way. The caller won when the returned owner is its own: a new
// record (generation 1), a replaced stale completed record, or a takeover
// of an expired lease (generation + 1, recovery point kept). Otherwise the
// row is the record someone else holds or completed, and a replay or an
// in-progress answer costs this one statement. The one case that needs a
// second read is a conflicting insert that committed after the statement
// began on PostgreSQL (the conflict sees it, the statement's snapshot does
// not). The
// completer's takeover-only claim (idempotency.Claim.TakeoverOnly) is a
// single conditional UPDATE ... RETURNING with the same takeover condition:
// it never inserts a record and never restarts a completed one. Every later
// write (heartbeat, recovery point, completion, release) is an UPDATE or
// DELETE conditional on owner, generation and the in-progress state, and
// returns idempotency.ErrLeaseLost when it changed nothing.
//
// Statements per guarded request, beyond the handler's own: a replay or an
// in-progress conflict is one (the claim). A fresh key is the claim plus the
// completion: inside the handler's unit when it asked for one (the UPDATE,
// with BEGIN and COMMIT of its transaction), otherwise Store.Complete, one
// conditional UPDATE in autocommit: two statements in all (the statement
// tests count them). On SQLite the
// Store prepares its statements once per connection; pgx caches its own on
// PostgreSQL.
//
// # Transactions
//
// Store.Begin starts a unit of work whose context carries the *sql.Tx; a
// handler gets it with Tx(r.Context()) and writes its business rows in it, so
// that they commit together with the stored response, or roll back together
// when the handler fails or the lease was lost.
//
// Isolation. The fences assume READ COMMITTED on PostgreSQL: a conditional
// write that waited for a row a concurrent takeover changed re-reads the new
// row, matches nothing and reports idempotency.ErrLeaseLost. So a unit's
// transaction is begun READ COMMITTED explicitly (sql.LevelReadCommitted),
// whatever the server's or role's default_transaction_isolation; the
// handler's own statements in it run READ COMMITTED as well. Under a default
// of REPEATABLE READ or SERIALIZABLE, the Store's stand-alone statements
// (claims, heartbeats, releases, completions outside a unit, the reaper's
// deletes) can still fail with a serialization failure (SQLSTATE 40001) or,
// under any level, a deadlock (40P01); the database then rolled the
// statement back, so the Store runs it again on a fresh snapshot, up to
// three times. A serialization failure or deadlock that still surfaces, and
// any inside a unit (whose transaction is then gone), is an *OpError
// matching ErrSerialization: a retryable store error, never
// idempotency.ErrLeaseLost, because nothing committed and the lease is still
// the caller's. When it ends the request's unit (the completion or its
// commit), the middleware answers 503 CodeStoreUnavailable and gives the key
// up, so the client's retry runs the request again; in an atomic phase it
// reaches the handler wrapped in the *idempotency.PhaseError, and nothing of
// the phase committed. SQLite
// transactions are serializable by construction (one writer at a time) and
// keep the driver's default options.
//
// Inside an atomic phase (idempotency.Run.Phase or Run.External), Tx(ctx)
// returns the phase's own transaction instead: the phase's rows commit
// together with its recovery point. Phases come before the request's own
// transaction: once Tx has opened that one, a new phase is refused with
// idempotency.ErrMisuse. A phase's output is []byte; convert it with
// string(out) before binding it where a TEXT column is expected, or SQLite
// stores a BLOB, which compares unequal to the same text (a foreign key to a
// TEXT id then fails).
//
// # Clocks
//
// The Store never reads a clock: lease ends, completion and update times are
// the times its callers pass, which come from each server's own clock. A
// takeover compares the lease end written by one server with the time of
// another, so in a fleet sharing PostgreSQL the servers' clocks must agree
// to well below the lease (idempotency.WithLease, 30 s; keep them in sync
// with NTP or similar, and lengthen the lease if they drift more). A server
// whose clock runs ahead by more than the time left on a lease sees it
// expired early and takes over a record whose owner is still working (the
// fence then stops the old owner's writes, but two executions of the
// handler overlapped); one whose clock runs behind takes over late, and
// keeps a crashed owner's key blocked for longer. The replay window and the
// cleanup horizon are compared across servers the same way, where skew
// matters far less.
//
// # PostgreSQL through pgx's native pool
//
// An application that already holds a *pgxpool.Pool gives the Store a
// *sql.DB over the same pool with stdlib.OpenDBFromPool (package
// github.com/jackc/pgx/v5/stdlib); the Store's and the application's
// connections then come from one pool and one configuration:
//
//	pool, err := pgxpool.New(ctx, dsn)
//	db := stdlib.OpenDBFromPool(pool)
//	store, err := sqlstore.Open(db, sqlstore.Postgres)
//
// Close the *sql.DB before the pool. To count or trace the Store's
// statements, set a pgx QueryTracer on the pool's or connection's config
// (pgx.ParseConfig, then stdlib.OpenDB(*cfg)).
//
// # SQLite
//
// Open SQLite with SQLiteDSN (WAL, a busy timeout, BEGIN IMMEDIATE
// transactions, foreign keys on) and keep more than one open connection.
// Open refuses a database whose busy timeout is under a second
// (ErrSQLiteBusyTimeout, which names SQLiteDSN), such as one opened with
// sql.Open("sqlite", "keys.db"): without it, concurrent requests fail with
// SQLITE_BUSY instead of waiting for the lock. One
// writer at a time holds SQLite's lock. A request's unit of work takes it when
// it begins (the middleware begins the unit when the handler first asks for
// Tx) and keeps it until it commits; meanwhile other requests' claims and
// heartbeats wait for it (up to the busy timeout, SQLiteBusyTimeoutMillis).
// So a duplicate that arrives while the first request runs usually gets the
// replay rather than the in-progress conflict, and a handler that holds its
// transaction longer than the busy timeout makes the waiting requests fail
// with 503. Keep transactional handlers short on SQLite, or use PostgreSQL,
// which locks only the record's row and only from the completion to the
// commit. Several processes may share the file on one host; use PostgreSQL
// for servers on several hosts.
//
// # Cleanup
//
// Records are never deleted by the claim path. Run the middleware's Reaper over
// the store to delete those past the cleanup horizon (72 hours by default)
// in bounded batches. Its DELETE re-checks the horizon on every row it
// deletes and, on PostgreSQL, skips rows that a running claim, heartbeat or
// completion holds (FOR UPDATE SKIP LOCKED), so it never waits for a request
// and never deletes a record that one just took over or completed:
//
//	stop := mw.Reaper().Start(ctx, 0) // mw := idempotency.New(store, ...)
//	defer stop()
package sqlstore
