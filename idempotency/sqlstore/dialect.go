package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// Dialect selects the SQL flavour the Store speaks. The zero value is not a
// valid dialect: use Postgres, SQLite or MySQL.
type Dialect int

const (
	// Postgres is PostgreSQL 9.5 or later (ON CONFLICT ... RETURNING), for a
	// fleet of servers sharing one store. Tested with the
	// github.com/jackc/pgx/v5/stdlib driver (driver name "pgx").
	Postgres Dialect = iota + 1
	// SQLite is SQLite 3.35 or later (UPSERT with RETURNING), the embedded
	// store for one process. Tested with the pure-Go modernc.org/sqlite
	// driver (driver name "sqlite"); open it with the DSN from SQLiteDSN.
	SQLite
	// MySQL is MySQL 8.0 or later or MariaDB 10.6 or later, with InnoDB
	// tables, for a fleet of servers sharing one store. Tested with the
	// github.com/go-sql-driver/mysql driver (driver name "mysql"); see the
	// package documentation, "MySQL and MariaDB".
	MySQL
)

// dialects are the implementations of the Dialects, by value.
var dialects = [...]dialect{
	Postgres: postgresDialect{}, SQLite: sqliteDialect{}, MySQL: mysqlDialect{},
}

// impl returns d's implementation, nil for an invalid Dialect.
func (d Dialect) impl() dialect {
	if d <= 0 || int(d) >= len(dialects) {
		return nil
	}
	return dialects[d]
}

// String returns "postgres", "sqlite", "mysql" or "Dialect(n)" for an
// invalid value.
func (d Dialect) String() string {
	if impl := d.impl(); impl != nil {
		return impl.name()
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// dialect is what the Store does differently on each database. Each
// implementation is one file (postgres.go, sqlite.go, mysql.go) holding its
// SQL and its upgrade steps; the Store's code never asks which one it has.
type dialect interface {
	// name is the Dialect's String.
	name() string
	// identify asks db, with the dialect's own query, whether it is the
	// dialect's database, and returns what it reports (such as
	// "PostgreSQL 15.2"). An error means the query did not run there.
	identify(ctx context.Context, db *sql.DB) (mine bool, server string, err error)
	// check refuses a pool that the Store cannot work with (Open).
	check(ctx context.Context, db *sql.DB) error
	// prepared reports whether the stand-alone statements are prepared
	// once on the *sql.DB (see stmtCache).
	prepared() bool
	// schema is the DDL of table.
	schema(table string) string
	// queries are the statements of a Store on table, in the dialect's
	// placeholders.
	queries(table string) queries
	// rebind turns the $N placeholders a statement is written with into
	// the dialect's.
	rebind(q string) string
	// text is the argument for a value of a TEXT column (owner,
	// fingerprint).
	text(v string) any
	// txOptions are the options of a unit's transaction.
	txOptions() *sql.TxOptions

	// claim runs the first statement of a claim that may create a record
	// (see Store.Claim) on q: it reports whether it created the record.
	claim(ctx context.Context, s *Store, q execer, c idempotency.Claim) (bool, error)
	// claimInTx runs, in tx, the transaction of a claim in one
	// transaction (Store.ClaimInUnit), what creates c's record when the
	// scope has none, waiting on a record another transaction holds
	// uncommitted for wait at most where the dialect can bound it: it
	// reports whether it created the record. It leaves the transaction's
	// lock wait as it was for the handler's statements; an error that
	// matches errSessionChanged says it could not, and the connection is
	// then discarded.
	claimInTx(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim,
		wait time.Duration) (bool, error)
	// heldPastWait reports whether err is claimInTx's wait running out.
	heldPastWait(err error) bool
	// win takes over or restarts rec, the record of c's scope that a read
	// on q found and that c wins, if it is still one c wins, on q (MySQL's
	// in a transaction of its own). sql.ErrNoRows when the record changed
	// so that c no longer wins it; an answer without Acquired when c lost
	// it to a write that committed meanwhile.
	win(ctx context.Context, s *Store, q execer, c idempotency.Claim, rec idempotency.Record) (
		idempotency.ClaimResult, error)
	// deleteBefore is Store.DeleteBefore for limit > 0 (horizon in Unix
	// nanoseconds), its errors plain.
	deleteBefore(ctx context.Context, s *Store, horizon, limit int64) (int, error)
	// confirmMiss tells, after a write fenced on l changed no row, whether
	// l still holds its record (nil) or not (idempotency.ErrLeaseLost).
	confirmMiss(ctx context.Context, s *Store, ex execer, l idempotency.Lease) error
	// migrate is Store.Migrate, its errors plain.
	migrate(ctx context.Context, s *Store) error
}

// DialectError is returned by Open when the database behind the *sql.DB is
// not the one the Dialect names: a SQLite pool declared Postgres, a
// PostgreSQL or MySQL pool declared SQLite, and so on, or a database that is
// none of them.
type DialectError struct {
	Declared Dialect // the Dialect given to Open
	Found    Dialect // the database found: Postgres, SQLite, MySQL, or 0 when none
	// Server is what the database reported, such as "PostgreSQL 15.2",
	// "SQLite 3.50.4" or "MariaDB 10.11.6".
	Server string
}

// Error names both dialects.
func (e *DialectError) Error() string {
	if e.Found.impl() != nil {
		return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is %s (%s)",
			e.Declared, e.Found, e.Server)
	}
	return fmt.Sprintf("sqlstore: Open with dialect %s, but the database is not %s (it reports %q)",
		e.Declared, e.Declared, e.Server)
}

// openTimeout bounds the queries Open runs to check the database.
const openTimeout = 10 * time.Second

// checkDialect identifies the database behind db with the query of the
// declared dialect d, and when that fails or names another database, with
// the other dialects', so that a *DialectError names what was found. When
// no query answers, it returns the declared query's error as an *OpError
// with Op "open".
func checkDialect(ctx context.Context, db *sql.DB, d Dialect) error {
	mine, server, err := d.impl().identify(ctx, db)
	if err == nil && mine {
		return nil
	}
	for other, impl := range dialects {
		if impl == nil || Dialect(other) == d {
			continue
		}
		if theirs, s, oerr := impl.identify(ctx, db); oerr == nil && theirs {
			return &DialectError{Declared: d, Found: Dialect(other), Server: s}
		}
	}
	if err != nil {
		return opErr("open", err)
	}
	return &DialectError{Declared: d, Server: server}
}

// DefaultTable is the table name used when WithTable is not given.
const DefaultTable = "idempotency_records"

// maxTableLen keeps the derived names ("<table>_pending_idx") within
// PostgreSQL's 63-byte identifier limit (MySQL's is 64).
const maxTableLen = 48

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// validTable reports whether name is an unquoted SQL identifier that every
// dialect accepts as it is: ASCII letters, digits and underscores, not
// starting with a digit, 1 to 48 characters.
func validTable(name string) bool {
	return len(name) > 0 && len(name) <= maxTableLen && identRE.MatchString(name)
}
