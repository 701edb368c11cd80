package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// ClaimIn runs one round of the Store's claim inside tx (on PostgreSQL and
// SQLite every statement of it), so that a test can hold a claim's row
// lock open while another connection works. It returns the record it
// claimed, or the one it found (another owner's) when the claim did not
// win, or sql.ErrNoRows when the round left the claim undecided.
func ClaimIn(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim) (idempotency.Record, error) {
	res, decided, err := s.claimRound(ctx, tx, c)
	if err == nil && !decided {
		err = sql.ErrNoRows
	}
	return res.Record, err
}

// HeartbeatIn runs the Store's heartbeat statement inside tx.
func HeartbeatIn(ctx context.Context, s *Store, tx *sql.Tx, l idempotency.Lease, until time.Time) error {
	return s.heartbeat(ctx, tx, l, until)
}

// GateDeleteBefore makes the Store's PostgreSQL DeleteBefore wait, after
// its snapshot is taken and before it locks a record in progress, for the
// advisory lock key (a shared transaction lock on it), so that a test that
// holds the lock can commit writes in that window.
func GateDeleteBefore(s *Store, key int64) {
	const at = "WHERE l.lease_until < $1"
	if !strings.Contains(s.q.deleteBefore, at) {
		panic("sqlstore: GateDeleteBefore: the statement has no " + at)
	}
	s.q.deleteBefore = strings.Replace(s.q.deleteBefore, at,
		fmt.Sprintf("WHERE (SELECT true FROM pg_advisory_xact_lock_shared(%d)) AND l.lease_until < $1", key), 1)
}

// UsePartialIndexes gives s, a PostgreSQL Store, SQLite's layout: two
// partial indexes and no list of leases (Migrate creates it).
func UsePartialIndexes(s *Store) {
	s.d = postgresPartial{}
	s.q = s.d.queries(s.table)
}
