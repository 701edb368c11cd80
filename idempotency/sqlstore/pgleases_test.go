package sqlstore_test

import (
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// On PostgreSQL the records in progress are listed in a table of their
// own, which the Completer and the Reaper read. Workers churn a few keys
// with every write the Store has (claims that create, take over and
// restart, heartbeats, ended leases, recovery points, completions in and
// out of a unit, units rolled back, releases, the Reaper's deletes), with
// skewed clocks, while the pool's backends are terminated
// (pg_terminate_backend) under them, so that statements fail at any
// point. Afterwards the list holds exactly the records in progress, each
// with the record's lease end, and Abandoned finds every one whose lease
// has ended.
func TestPostgresLeasesHoldTheRecordsInProgress(t *testing.T) {
	base := pgSchemaDSN(t)
	db := pgPool(t, withParam(base, "application_name", "leases_churn"), 8)
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	admin, err := sql.Open("pgx", base)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })

	const workers, ops, keys = 8, 100, 12
	var (
		step     atomic.Int64 // the shared clock, in steps of 100 ms
		failures atomic.Int64 // statements that failed (terminated connections)
		wg       sync.WaitGroup
		stop     = make(chan struct{})
	)
	ctx := t.Context()
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 28))
			now := func() time.Time { // each worker's clock, up to 300 ms off
				return t0.Add(time.Duration(step.Add(1))*100*time.Millisecond +
					time.Duration(rng.IntN(600)-300)*time.Millisecond)
			}
			note := func(err error) {
				if err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
					failures.Add(1)
				}
			}
			for i := range ops {
				c := claimAt(scope(fmt.Sprint("k", rng.IntN(keys))), fmt.Sprint("w", w, "-", i), "fp", now())
				c.LeaseFor, c.ReplayWindow = time.Second, 3*time.Second
				res, err := s.Claim(ctx, c)
				if err != nil {
					note(err)
					continue
				}
				if res.Outcome != idempotency.ClaimCreated && res.Outcome != idempotency.ClaimTakenOver {
					if rng.IntN(4) == 0 {
						_, err := s.DeleteBefore(ctx, now().Add(-2*time.Second), 3)
						note(err)
					}
					continue
				}
				l := res.Record.Lease()
				for range rng.IntN(3) {
					switch rng.IntN(3) {
					case 0:
						note(s.Heartbeat(ctx, l, now().Add(time.Second)))
					case 1:
						note(s.SetRecoveryPoint(ctx, l, "p", []byte("d"), now()))
					default:
						note(s.Heartbeat(ctx, l, now())) // ends the lease
					}
				}
				resp := idempotency.Response{Status: 201, Body: []byte("ok")}
				switch rng.IntN(6) {
				case 0, 1:
					note(s.Complete(ctx, l, resp, now()))
				case 2:
					u, uctx, _ := s.Begin(ctx, l)
					if tx, ok := sqlstore.Tx(uctx); ok {
						_, err := tx.ExecContext(uctx, `SELECT 1`)
						note(err)
					}
					note(u.Complete(uctx, resp, now()))
					if rng.IntN(2) == 0 {
						note(u.Commit())
					}
					_ = u.Rollback()
				case 3:
					note(s.Release(ctx, l))
				default: // abandoned: its lease runs out
				}
			}
		})
	}
	var killed atomic.Int64
	var killer sync.WaitGroup
	killer.Go(func() {
		rng := rand.New(rand.NewPCG(28, 28))
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(10+rng.IntN(15)) * time.Millisecond):
			}
			var n int64
			if err := admin.QueryRow(`SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM (SELECT pid FROM pg_stat_activity WHERE application_name = 'leases_churn'
	ORDER BY random() LIMIT 1) b`).Scan(&n); err == nil {
				killed.Add(n)
			}
		}
	})
	wg.Wait()
	close(stop)
	killer.Wait()
	require.Positive(t, killed.Load(), "no backend was terminated")
	require.Positive(t, failures.Load(), "no statement failed")
	db.SetMaxIdleConns(0) // the pool's connections the killer may have ended go
	db.SetMaxIdleConns(2)
	left := claimAt(scope("left"), "last", "fp", t0.Add(time.Duration(step.Load())*100*time.Millisecond))
	_, won, err := claimed(s.Claim(ctx, left)) // at least one record stays in progress
	require.NoError(t, err)
	require.True(t, won)

	var missing, extra, wrongEnd, inProgress int
	require.NoError(t, admin.QueryRow(`SELECT
	(SELECT count(*) FROM idempotency_records r WHERE state = 1
		AND NOT EXISTS (SELECT 1 FROM idempotency_records_leases l WHERE l.scope_hash = r.scope_hash)),
	(SELECT count(*) FROM idempotency_records_leases l WHERE NOT EXISTS
		(SELECT 1 FROM idempotency_records r WHERE r.scope_hash = l.scope_hash AND r.state = 1)),
	(SELECT count(*) FROM idempotency_records r JOIN idempotency_records_leases l USING (scope_hash)
		WHERE r.lease_until <> l.lease_until),
	(SELECT count(*) FROM idempotency_records WHERE state = 1)`).
		Scan(&missing, &extra, &wrongEnd, &inProgress))
	require.Zero(t, missing, "records in progress missing from the list")
	require.Zero(t, extra, "listed leases of no record in progress")
	require.Zero(t, wrongEnd, "listed lease ends that are not the record's")
	require.Positive(t, inProgress, "no record was left in progress")

	later := t0.Add(time.Duration(step.Load()+200) * 100 * time.Millisecond)
	abandoned, err := s.Abandoned(ctx, later, keys+2)
	require.NoError(t, err)
	require.Len(t, abandoned, inProgress, "Abandoned finds every record in progress past its lease")
	t.Logf("%d backends terminated, %d statements failed, %d records left in progress",
		killed.Load(), failures.Load(), inProgress)
}

// The Reaper's statement on PostgreSQL reads its candidates from its
// snapshot. A record in progress past the horizon completes and restarts
// (a new lease) after that snapshot and before the Reaper locks it (the
// statement waits at an advisory lock the test holds meanwhile): the
// Reaper skips it, since the lease it read is gone, rather than delete the
// restarted record and leave its new lease listed with no record.
func TestPostgresReaperSkipsARecordWhoseLeaseBeganAgain(t *testing.T) {
	ctx := t.Context()
	base := pgSchemaDSN(t)
	db, err := sql.Open("pgx", withParam(base, "application_name", "reaper_gated"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx))
	rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
	require.NoError(t, err)
	require.True(t, won)

	// The gate: an advisory lock the Reaper's statement waits for once its
	// snapshot is taken.
	admin, err := sql.Open("pgx", base)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	gate, err := admin.Conn(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = gate.Close() })
	const key = 2801
	_, err = gate.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, key)
	require.NoError(t, err)
	sqlstore.GateDeleteBefore(s, key)
	deleted := make(chan int, 1)
	go func() {
		n, err := s.DeleteBefore(ctx, t0.Add(3*time.Hour), 10)
		assert.NoError(t, err)
		deleted <- n
	}()
	require.Eventually(t, func() bool {
		return count(t, admin, `SELECT count(*) FROM pg_stat_activity
WHERE application_name = 'reaper_gated' AND wait_event_type = 'Lock' AND wait_event = 'advisory'`) == 1
	}, 10*time.Second, 5*time.Millisecond, "the Reaper's statement did not reach its gate")
	require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201}, t0.Add(time.Second)))
	restarted, err := s.Claim(ctx, claimAt(scope("k"), "B", "fp", t0.Add(2*time.Hour)))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, restarted.Outcome, "the completed record restarts past the window")
	_, err = gate.ExecContext(ctx, `SELECT pg_advisory_unlock($1)`, key)
	require.NoError(t, err)

	require.Zero(t, <-deleted, "the Reaper deleted the restarted record")
	got, err := s.Get(ctx, scope("k"))
	require.NoError(t, err)
	require.Equal(t, "B", got.Owner)
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM `+leasesTable+` l JOIN `+sqlstore.DefaultTable+
		` r USING (scope_hash) WHERE r.state = 1 AND l.lease_until = r.lease_until`), "the new lease is listed")
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM `+leasesTable))
}
