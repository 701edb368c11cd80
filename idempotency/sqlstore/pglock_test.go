package sqlstore_test

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// openPGAgain opens another pool on the schema of db (a pool from openPG),
// with at most maxConns connections (1 lets backendPID name its backend) and
// extra DSN parameters (key, value pairs) such as a session's
// default_transaction_isolation.
func openPGAgain(t *testing.T, db *sql.DB, maxConns int, params ...string) *sql.DB {
	t.Helper()
	var schema string
	require.NoError(t, db.QueryRow(`SELECT current_schema()`).Scan(&schema))
	dsn := withParam(pgDSN(t), "search_path", schema)
	for i := 0; i+1 < len(params); i += 2 {
		dsn = withParam(dsn, params[i], url.PathEscape(params[i+1]))
	}
	other, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	other.SetMaxOpenConns(maxConns)
	t.Cleanup(func() { _ = other.Close() })
	require.NoError(t, other.Ping())
	return other
}

// backendPID returns the PostgreSQL backend of a one-connection pool.
func backendPID(t *testing.T, db *sql.DB) int {
	t.Helper()
	var pid int
	require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&pid))
	return pid
}

// waitLockedOrDone waits until the backend pid waits for a lock (true) or
// done is closed (false), polling pg_stat_activity through admin. It fails
// the test after 10 s of neither.
func waitLockedOrDone(t *testing.T, admin *sql.DB, pid int, done <-chan struct{}) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return false
		default:
		}
		var waiting bool
		err := admin.QueryRow(`SELECT COALESCE(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting)
		require.NoError(t, err)
		if waiting {
			return true
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatal("the statement neither finished nor waited for a lock within 10 s")
	return false
}

// TestPostgresReaperSparesARecordAConcurrentWriteRevives holds, in an open
// transaction on one connection, a write that moves a record past the
// cleanup horizon out of the reaper's reach (a takeover, a fresh start over
// a stale completed record, a heartbeat, a completion, a recovery point),
// while DeleteBefore runs on another connection; then commits it. The record
// must survive: under READ COMMITTED a DELETE that waited for the row would
// otherwise re-check only the primary key against the new row version and
// delete what the concurrent write just revived. The reaper also skips the
// locked row instead of waiting for it, and still deletes the unlocked stale
// record beside it.
func TestPostgresReaperSparesARecordAConcurrentWriteRevives(t *testing.T) {
	now := t0.Add(200 * time.Hour)
	old := now.Add(-100 * time.Hour)
	horizon := now.Add(-72 * time.Hour) // the default cleanup horizon

	cases := []struct {
		name string
		// setup leaves a record "k" past the horizon.
		setup func(t *testing.T, s *sqlstore.Store) idempotency.Record
		// write makes the concurrent write in tx (or in a unit whose
		// transaction it began, whose Commit ends it) and returns what
		// commits it.
		write func(t *testing.T, s *sqlstore.Store, db *sql.DB, stale idempotency.Record) (commit func() error)
		// check asserts the record after the commit.
		check func(t *testing.T, rec idempotency.Record)
	}{
		{
			name: "takeover of an abandoned record",
			setup: func(t *testing.T, s *sqlstore.Store) idempotency.Record {
				rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", old)))
				require.NoError(t, err)
				return rec
			},
			write: func(t *testing.T, s *sqlstore.Store, db *sql.DB, _ idempotency.Record) func() error {
				tx, err := db.BeginTx(t.Context(), nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				rec, err := sqlstore.ClaimIn(t.Context(), s, tx, claimAt(scope("k"), "B", "fp", now))
				require.NoError(t, err)
				require.Equal(t, "B", rec.Owner)
				return tx.Commit
			},
			check: func(t *testing.T, rec idempotency.Record) {
				require.Equal(t, "B", rec.Owner)
				require.Equal(t, int64(2), rec.Generation)
				require.Equal(t, idempotency.InProgress, rec.State)
			},
		},
		{
			name: "fresh start over a stale completed record",
			setup: func(t *testing.T, s *sqlstore.Store) idempotency.Record {
				rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", old)))
				require.NoError(t, err)
				require.NoError(t, s.Complete(t.Context(), rec.Lease(), idempotency.Response{Status: 201}, old))
				return rec
			},
			write: func(t *testing.T, s *sqlstore.Store, db *sql.DB, _ idempotency.Record) func() error {
				tx, err := db.BeginTx(t.Context(), nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				rec, err := sqlstore.ClaimIn(t.Context(), s, tx, claimAt(scope("k"), "B", "fp2", now))
				require.NoError(t, err)
				require.Equal(t, "B", rec.Owner)
				return tx.Commit
			},
			check: func(t *testing.T, rec idempotency.Record) {
				require.Equal(t, "B", rec.Owner)
				require.Equal(t, "fp2", rec.Fingerprint)
				require.Equal(t, idempotency.InProgress, rec.State)
			},
		},
		{
			name: "heartbeat of a late owner",
			setup: func(t *testing.T, s *sqlstore.Store) idempotency.Record {
				rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", old)))
				require.NoError(t, err)
				return rec
			},
			write: func(t *testing.T, s *sqlstore.Store, db *sql.DB, stale idempotency.Record) func() error {
				tx, err := db.BeginTx(t.Context(), nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				require.NoError(t, sqlstore.HeartbeatIn(t.Context(), s, tx, stale.Lease(), now.Add(time.Minute)))
				return tx.Commit
			},
			check: func(t *testing.T, rec idempotency.Record) {
				require.Equal(t, "A", rec.Owner)
				require.True(t, rec.LeaseUntil.Equal(now.Add(time.Minute)))
			},
		},
		{
			name: "completion in a unit",
			setup: func(t *testing.T, s *sqlstore.Store) idempotency.Record {
				rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", old)))
				require.NoError(t, err)
				return rec
			},
			write: func(t *testing.T, s *sqlstore.Store, _ *sql.DB, stale idempotency.Record) func() error {
				u, uctx, err := s.Begin(t.Context(), stale.Lease())
				require.NoError(t, err)
				t.Cleanup(func() { _ = u.Rollback() })
				_, began := sqlstore.Tx(uctx) // as a handler that writes: the unit's transaction is open
				require.True(t, began)
				require.NoError(t, u.Complete(t.Context(), idempotency.Response{Status: 201, Body: []byte("done")}, now))
				return u.Commit
			},
			check: func(t *testing.T, rec idempotency.Record) {
				require.Equal(t, idempotency.Completed, rec.State)
				require.NotNil(t, rec.Response)
				require.Equal(t, "done", string(rec.Response.Body))
			},
		},
		{
			name: "recovery point in a unit",
			setup: func(t *testing.T, s *sqlstore.Store) idempotency.Record {
				rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", old)))
				require.NoError(t, err)
				return rec
			},
			write: func(t *testing.T, s *sqlstore.Store, _ *sql.DB, stale idempotency.Record) func() error {
				u, uctx, err := s.Begin(t.Context(), stale.Lease())
				require.NoError(t, err)
				t.Cleanup(func() { _ = u.Rollback() })
				_, began := sqlstore.Tx(uctx) // as a handler that writes: the unit's transaction is open
				require.True(t, began)
				require.NoError(t, u.SetRecoveryPoint(t.Context(), "charged", []byte("ch_1"), now))
				return u.Commit
			},
			check: func(t *testing.T, rec idempotency.Record) {
				require.Equal(t, "charged", rec.RecoveryPoint)
				require.Equal(t, idempotency.InProgress, rec.State)
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			s, db := newStore(t, backends[1])
			stale := tc.setup(t, s)
			// A stale record nobody touches: the reaper must delete it.
			other, _, err := claimed(s.Claim(ctx, claimAt(scope("other"), "A", "fp", old)))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, other.Lease(), idempotency.Response{Status: 201}, old))

			commit := tc.write(t, s, db, stale)

			reaperDB := openPGAgain(t, db, 1)
			reaper, err := sqlstore.Open(reaperDB, sqlstore.Postgres)
			require.NoError(t, err)
			pid := backendPID(t, reaperDB)
			var (
				deleted int
				delErr  error
				done    = make(chan struct{})
			)
			go func() {
				defer close(done)
				deleted, delErr = reaper.DeleteBefore(context.Background(), horizon, 10)
			}()
			waited := waitLockedOrDone(t, db, pid, done)
			require.NoError(t, commit())
			<-done
			require.NoError(t, delErr)

			rec, err := s.Get(ctx, scope("k"))
			require.NoError(t, err, "the reaper deleted a record that a concurrent write revived")
			tc.check(t, rec)
			_, err = s.Get(ctx, scope("other"))
			require.ErrorIs(t, err, idempotency.ErrNotFound, "the untouched stale record is reaped")
			require.Equal(t, 1, deleted)
			require.False(t, waited, "the reaper waited for a row lock instead of skipping the row")

			// Committed, the revived record is out of the reaper's reach.
			n, err := reaper.DeleteBefore(ctx, horizon, 10)
			require.NoError(t, err)
			require.Zero(t, n)
		})
	}
}
