package sqlstore

import (
	"context"
	"database/sql"
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
