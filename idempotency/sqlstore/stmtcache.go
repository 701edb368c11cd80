package sqlstore

import (
	"context"
	"database/sql"
	"sync"
)

// stmtCache runs the Store's stand-alone statements, on SQLite as
// statements prepared once on its *sql.DB (database/sql then prepares each
// on a connection the first time it runs there, and keeps it): SQLite parses
// a statement on every unprepared call, and the claim's parse cost more than
// the rest of the request; on MySQL too, where a prepared statement runs in
// one round trip whatever the DSN (an unprepared one with arguments takes
// two unless interpolateParams is set). pgx caches the statements it runs on each
// connection itself; through database/sql's prepared statements PostgreSQL
// measured no faster (rather slower), so with prepare false every call runs
// unprepared on the *sql.DB. A statement whose preparation fails runs
// unprepared too, where it meets the same error or succeeds. The prepared
// statements live as long as the *sql.DB: make one Store per table and
// keep it, rather than a new Store per request.
type stmtCache struct {
	db      *sql.DB
	prepare bool
	mu      sync.Mutex
	stmts   map[string]*sql.Stmt
}

func (c *stmtCache) stmt(ctx context.Context, q string) *sql.Stmt {
	if !c.prepare {
		return nil
	}
	c.mu.Lock()
	st, ok := c.stmts[q]
	c.mu.Unlock()
	if ok {
		return st
	}
	// Prepared outside the lock: preparing may wait for a connection, and
	// calls of statements already prepared must not queue behind it.
	st, err := c.db.PrepareContext(ctx, q)
	if err != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if prev, ok := c.stmts[q]; ok { // another call prepared it meanwhile
		_ = st.Close()
		return prev
	}
	if c.stmts == nil {
		c.stmts = map[string]*sql.Stmt{}
	}
	c.stmts[q] = st
	return st
}

// QueryRowContext runs q, prepared, with args.
func (c *stmtCache) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	if st := c.stmt(ctx, q); st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	return c.db.QueryRowContext(ctx, q, args...)
}

// ExecContext runs q, prepared, with args.
func (c *stmtCache) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	if st := c.stmt(ctx, q); st != nil {
		return st.ExecContext(ctx, args...)
	}
	return c.db.ExecContext(ctx, q, args...)
}
