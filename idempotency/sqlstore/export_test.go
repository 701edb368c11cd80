package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// ClaimIn runs the Store's claim statement once inside tx, so that a test can
// hold a claim's row lock open while another connection works. It returns
// the record it claimed, or the one it found (another owner's) when the
// claim did not win, or sql.ErrNoRows when the statement returned no row.
func ClaimIn(ctx context.Context, s *Store, tx *sql.Tx, c idempotency.Claim) (idempotency.Record, error) {
	res, err := s.claimOnce(ctx, tx, c)
	return res.Record, err
}

// HeartbeatIn runs the Store's heartbeat statement inside tx.
func HeartbeatIn(ctx context.Context, s *Store, tx *sql.Tx, l idempotency.Lease, until time.Time) error {
	return s.heartbeat(ctx, tx, l, until)
}

// PauseDeleteBefore makes the Store's PostgreSQL DeleteBefore sleep for d
// after its snapshot is taken and before it locks a record in progress,
// so that a test can commit writes in that window.
func PauseDeleteBefore(s *Store, d time.Duration) {
	s.q.deleteBefore = strings.Replace(s.q.deleteBefore, "WHERE l.lease_until < $1",
		fmt.Sprintf("WHERE (SELECT true FROM pg_sleep(%f)) AND l.lease_until < $1", d.Seconds()), 1)
}
