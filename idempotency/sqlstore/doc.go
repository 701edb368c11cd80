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
//	err = store.Migrate(ctx)                               // CREATE TABLE IF NOT EXISTS ...
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//
// # Schema
//
// Schema creation is explicit: Migrate runs the DDL that Store.Schema
// returns, or you run it with your own migration tool. For PostgreSQL and
// the default table it is:
//
//	CREATE TABLE IF NOT EXISTS idempotency_records (
//		principal           TEXT     NOT NULL,
//		method              TEXT     NOT NULL,
//		route               TEXT     NOT NULL,
//		idem_key            TEXT     NOT NULL,
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
//		response_header     TEXT,              -- JSON object of header name to values
//		response_body       BYTEA,
//		created_at          BIGINT   NOT NULL,
//		updated_at          BIGINT   NOT NULL,
//		completed_at        BIGINT   NOT NULL DEFAULT 0, -- 0 until completed
//		PRIMARY KEY (principal, method, route, idem_key)
//	);
//	CREATE INDEX IF NOT EXISTS idempotency_records_lease_idx ON idempotency_records (state, lease_until);
//	CREATE INDEX IF NOT EXISTS idempotency_records_updated_idx ON idempotency_records (updated_at);
//
// SQLite's is the same with BLOB for BYTEA. Times are integer nanoseconds
// since the Unix epoch in both dialects, so every comparison is exact and
// never depends on a database clock or time zone: the store uses only the
// times its callers pass.
//
// # Claims and fences
//
// A claim is one statement, never a read followed by a write:
//
//	INSERT ... VALUES (...)
//	ON CONFLICT (principal, method, route, idem_key) DO UPDATE SET ...
//	WHERE (completed AND completed_at < now - replay window)
//	   OR (in progress AND lease_until < now AND fingerprint = excluded.fingerprint)
//	RETURNING ...
//
// A returned row means the caller won: a new record (generation 1), a
// replaced stale completed record, or a takeover of an expired lease
// (generation + 1, recovery point kept). No row means someone else holds
// the record; the store then reads it only to say what to answer. The
// completer's takeover-only claim (idempotency.Claim.TakeoverOnly) is a
// single conditional UPDATE ... RETURNING with the same takeover condition:
// it never inserts a record and never restarts a completed one. Every later
// write (heartbeat, recovery point, completion, release) is an UPDATE or
// DELETE conditional on owner, generation and the in-progress state, and
// returns idempotency.ErrLeaseLost when it changed nothing.
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
// idempotency.ErrPhaseMisuse. A phase's output is []byte; convert it with
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
// to well below the lease (idempotency.DefaultLease, 30 s; keep them in sync
// with NTP or similar, and lengthen the lease if they drift more). A server
// whose clock runs ahead by more than the time left on a lease sees it
// expired early and takes over a record whose owner is still working (the
// fence then stops the old owner's writes, but two executions of the
// handler overlapped); one whose clock runs behind takes over late, and
// keeps a crashed owner's key blocked for longer. The replay window and the
// cleanup horizon are compared across servers the same way, where skew
// matters far less.
//
// # SQLite
//
// Open SQLite with SQLiteDSN (WAL, a busy timeout, BEGIN IMMEDIATE
// transactions, foreign keys on) and keep more than one open connection. One
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
// Records are never deleted by the claim path. Run idempotency.Reaper over
// the store to delete those past the cleanup horizon (72 hours by default)
// in bounded batches. Its DELETE re-checks the horizon on every row it
// deletes and, on PostgreSQL, skips rows that a running claim, heartbeat or
// completion holds (FOR UPDATE SKIP LOCKED), so it never waits for a request
// and never deletes a record that one just took over or completed:
//
//	stop := idempotency.NewReaper(store, idempotency.ReaperConfig{}).Start(ctx)
//	defer stop()
package sqlstore
