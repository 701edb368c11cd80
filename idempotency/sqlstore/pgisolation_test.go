package sqlstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// strictLevels are the session defaults under which a statement that meets a
// row changed after its snapshot fails with SQLSTATE 40001 instead of
// re-reading it, as READ COMMITTED does.
var strictLevels = []string{"repeatable read", "serializable"}

// TestPostgresUnitIsReadCommittedWhateverTheServerDefault runs a unit on a
// session whose default isolation is REPEATABLE READ or SERIALIZABLE. The
// unit takes its snapshot with a business read, a successor takes the lease
// over and commits, and then the unit completes: the completion must find
// no row it owns (idempotency.ErrLeaseLost), not fail with a serialization
// error, because the unit runs READ COMMITTED explicitly.
func TestPostgresUnitIsReadCommittedWhateverTheServerDefault(t *testing.T) {
	for _, level := range strictLevels {
		t.Run(level, func(t *testing.T) {
			ctx := t.Context()
			_, db := newStore(t, backends[1])
			strictDB := openPGAgain(t, db, 4, "default_transaction_isolation", level)
			var got string
			require.NoError(t, strictDB.QueryRow(`SHOW default_transaction_isolation`).Scan(&got))
			require.Equal(t, level, got, "the session default applies")
			s, err := sqlstore.Open(strictDB, sqlstore.Postgres)
			require.NoError(t, err)
			successor, err := sqlstore.Open(db, sqlstore.Postgres)
			require.NoError(t, err)

			rec, ok, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
			require.NoError(t, err)
			require.True(t, ok)
			u, uctx, err := s.Begin(ctx, rec.Lease())
			require.NoError(t, err)
			defer func() { _ = u.Rollback() }()
			tx, ok := sqlstore.Tx(uctx)
			require.True(t, ok)
			require.NoError(t, tx.QueryRowContext(ctx, `SHOW transaction_isolation`).Scan(&got))
			require.Equal(t, "read committed", got)
			var n int
			require.NoError(t, tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM idempotency_records`).Scan(&n))

			taken, ok, err := claimed(successor.Claim(ctx, claimAt(scope("k"), "B", "fp", t0.Add(time.Minute))))
			require.NoError(t, err)
			require.True(t, ok)

			err = u.Complete(ctx, idempotency.Response{Status: 201}, t0.Add(time.Minute))
			require.ErrorIs(t, err, idempotency.ErrLeaseLost)
			require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost)
			cur, err := s.Get(ctx, scope("k"))
			require.NoError(t, err)
			require.Equal(t, taken.Lease(), cur.Lease())
			require.Equal(t, idempotency.InProgress, cur.State)
		})
	}
}

// TestPostgresStatementsRetrySerializationFailures runs the Store's
// stand-alone statements on a session whose default isolation is REPEATABLE
// READ or SERIALIZABLE, each waiting for a row that a successor's open
// takeover holds. Once the takeover commits, the waiting statement's
// snapshot is stale and PostgreSQL fails it with SQLSTATE 40001; the Store
// runs it again on a fresh snapshot and gives the READ COMMITTED answer:
// idempotency.ErrLeaseLost for the old owner's writes, the successor's record
// for a third claimant.
func TestPostgresStatementsRetrySerializationFailures(t *testing.T) {
	later := t0.Add(time.Minute)
	ops := []struct {
		name string
		run  func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error
	}{
		{"heartbeat", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			return s.Heartbeat(ctx, old, later.Add(time.Minute))
		}},
		{"complete", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			return s.Complete(ctx, old, idempotency.Response{Status: 201}, later)
		}},
		{"set recovery point", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			return s.SetRecoveryPoint(ctx, old, "charged", nil, later)
		}},
		{"release", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			return s.Release(ctx, old)
		}},
		{"claim", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			rec, ok, err := claimed(s.Claim(ctx, claimAt(scope("k"), "C", "fp", later)))
			if err != nil {
				return err
			}
			if ok || rec.Owner != "B" {
				return errUnexpected{rec, ok}
			}
			return idempotency.ErrLeaseLost // C lost to B, as the writes of A do
		}},
		{"takeover-only claim", func(ctx context.Context, s *sqlstore.Store, old idempotency.Lease) error {
			rec, ok, err := claimed(s.Claim(ctx, takeoverOnly(scope("k"), "C", "fp", later)))
			if err != nil {
				return err
			}
			if ok || rec.Owner != "B" {
				return errUnexpected{rec, ok}
			}
			return idempotency.ErrLeaseLost
		}},
	}
	for _, level := range strictLevels {
		for _, op := range ops {
			t.Run(level+"/"+op.name, func(t *testing.T) {
				ctx := t.Context()
				successor, db := newStore(t, backends[1])
				strictDB := openPGAgain(t, db, 1, "default_transaction_isolation", level)
				s, err := sqlstore.Open(strictDB, sqlstore.Postgres)
				require.NoError(t, err)
				pid := backendPID(t, strictDB)

				rec, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
				require.NoError(t, err)
				tx, err := db.BeginTx(ctx, nil)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback() }()
				taken, err := sqlstore.ClaimIn(ctx, successor, tx, claimAt(scope("k"), "B", "fp", later))
				require.NoError(t, err)

				done := make(chan struct{})
				var opErr error
				go func() {
					defer close(done)
					opErr = op.run(context.Background(), s, rec.Lease())
				}()
				require.True(t, waitLockedOrDone(t, db, pid, done), "the statement waits for the takeover's row")
				require.NoError(t, tx.Commit())
				<-done
				require.ErrorIs(t, opErr, idempotency.ErrLeaseLost)
				require.NotErrorIs(t, opErr, sqlstore.ErrSerialization)

				cur, err := successor.Get(ctx, scope("k"))
				require.NoError(t, err)
				require.Equal(t, taken.Lease(), cur.Lease())
				require.Equal(t, idempotency.InProgress, cur.State)
			})
		}
	}
}

type errUnexpected struct {
	rec idempotency.Record
	ok  bool
}

func (e errUnexpected) Error() string {
	return "unexpected claim result: owner " + e.rec.Owner
}

// TestPostgresUnitDeadlockIsARetryableStoreError makes a unit the victim of
// a deadlock (SQLSTATE 40P01) in its completion: the unit holds a business
// row another transaction waits for, and that transaction holds the record's
// row. The completion fails with an *OpError that matches ErrSerialization,
// not idempotency.ErrLeaseLost: nothing of the unit committed and the lease
// is still the owner's, which can complete (or release) it afterwards.
func TestPostgresUnitDeadlockIsARetryableStoreError(t *testing.T) {
	ctx := t.Context()
	other, db := newStore(t, backends[1])
	_, err := db.Exec(`CREATE TABLE accounts (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO accounts (id, n) VALUES (1, 0)`)
	require.NoError(t, err)
	victimDB := openPGAgain(t, db, 1)
	// The victim detects the cycle long before the other side (default 1 s).
	if _, err := victimDB.Exec(`SET deadlock_timeout = '10ms'`); err != nil {
		t.Skipf("cannot shorten deadlock_timeout (needs a superuser): %v", err)
	}
	s, err := sqlstore.Open(victimDB, sqlstore.Postgres)
	require.NoError(t, err)

	rec, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	u, uctx, err := s.Begin(ctx, rec.Lease())
	require.NoError(t, err)
	defer func() { _ = u.Rollback() }()
	tx1, ok := sqlstore.Tx(uctx)
	require.True(t, ok)
	_, err = tx1.ExecContext(ctx, `UPDATE accounts SET n = n + 1 WHERE id = 1`)
	require.NoError(t, err)

	tx2, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx2.Rollback() }()
	var pid2 int
	require.NoError(t, tx2.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid2))
	_, err = tx2.ExecContext(ctx, `SELECT 1 FROM idempotency_records WHERE idem_key = 'k' FOR UPDATE`)
	require.NoError(t, err)
	done := make(chan struct{})
	var err2 error
	go func() {
		defer close(done)
		_, err2 = tx2.ExecContext(context.Background(), `UPDATE accounts SET n = n + 10 WHERE id = 1`)
	}()
	require.True(t, waitLockedOrDone(t, db, pid2, done), "the other transaction waits for the unit's business row")

	err = u.Complete(ctx, idempotency.Response{Status: 201}, t0.Add(time.Second))
	require.ErrorIs(t, err, sqlstore.ErrSerialization)
	require.NotErrorIs(t, err, idempotency.ErrLeaseLost)
	var oe *sqlstore.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "complete", oe.Op)
	require.Error(t, u.Commit(), "the unit's transaction is gone")
	require.NoError(t, u.Rollback())

	<-done
	require.NoError(t, err2)
	require.NoError(t, tx2.Commit())
	var n int
	require.NoError(t, db.QueryRow(`SELECT n FROM accounts WHERE id = 1`).Scan(&n))
	require.Equal(t, 10, n, "nothing of the unit committed")
	cur, err := other.Get(ctx, scope("k"))
	require.NoError(t, err)
	require.Equal(t, rec.Lease(), cur.Lease(), "the lease is still the owner's")
	require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201}, t0.Add(time.Second)))
}
