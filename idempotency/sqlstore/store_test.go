package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)

func scope(key string) idempotency.Scope {
	return idempotency.Scope{Principal: "acct_1", Method: "POST", Route: "/payments", Key: key}
}

func claimAt(sc idempotency.Scope, owner, fp string, now time.Time) idempotency.Claim {
	return idempotency.Claim{
		Scope: sc, Fingerprint: fp, FingerprintVersion: 1, Owner: owner,
		Request: []byte("req-" + owner), Now: now, LeaseFor: 10 * time.Second, ReplayWindow: time.Hour,
	}
}

func TestOpenRejectsBadArguments(t *testing.T) {
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "args.db")))
	require.NoError(t, err)
	defer db.Close()

	_, err = sqlstore.Open(nil, sqlstore.SQLite)
	require.ErrorIs(t, err, sqlstore.ErrInvalidConfig)
	require.ErrorContains(t, err, "nil *sql.DB")
	_, err = sqlstore.Open(db, sqlstore.Dialect(0))
	require.ErrorIs(t, err, sqlstore.ErrInvalidConfig)
	require.ErrorContains(t, err, "dialect")
	_, err = sqlstore.Open(db, sqlstore.Dialect(9))
	require.ErrorIs(t, err, sqlstore.ErrInvalidConfig)
	for _, bad := range []string{"", "1abc", "a-b", "a b", "x;drop table y", `"q"`, "s.t", strings.Repeat("a", 49), "é"} {
		_, err = sqlstore.Open(db, sqlstore.SQLite, sqlstore.WithTable(bad))
		require.ErrorIs(t, err, sqlstore.ErrInvalidConfig, "table %q", bad)
		require.ErrorContains(t, err, "table name")
	}
	s, err := sqlstore.Open(db, sqlstore.SQLite, sqlstore.WithTable("_Idem_2"))
	require.NoError(t, err)
	require.Contains(t, s.Schema(), "CREATE TABLE IF NOT EXISTS _Idem_2 (")
	require.Contains(t, s.Schema(), "scope_hash          BLOB    NOT NULL PRIMARY KEY")
	require.NotContains(t, s.Schema(), "BYTEA")
	s, err = sqlstore.Open(db, sqlstore.SQLite)
	require.NoError(t, err)
	require.Contains(t, s.Schema(), "CREATE TABLE IF NOT EXISTS "+sqlstore.DefaultTable+" (")
	require.Equal(t, "sqlite", sqlstore.SQLite.String())
	require.Equal(t, "postgres", sqlstore.Postgres.String())
	require.Equal(t, "Dialect(7)", sqlstore.Dialect(7).String())
}

func TestMigrateIsIdempotentAndTablesAreIndependent(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		require.NoError(t, s.Migrate(ctx))
		other, err := sqlstore.Open(db, b.dialect, sqlstore.WithTable("other_records"))
		require.NoError(t, err)
		require.NoError(t, other.Migrate(ctx))

		_, ok, err := claimed(s.Claim(ctx, claimAt(scope("k"), "o1", "fp", t0)))
		require.NoError(t, err)
		require.True(t, ok)
		_, err = other.Get(ctx, scope("k"))
		require.ErrorIs(t, err, idempotency.ErrNotFound)
		_, ok, err = claimed(other.Claim(ctx, claimAt(scope("k"), "o2", "fp", t0)))
		require.NoError(t, err)
		require.True(t, ok, "another table is another store")
	})
}

func TestMissingTableIsAnOpError(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		db := b.open(t)
		s, err := sqlstore.Open(db, b.dialect)
		require.NoError(t, err)
		_, _, err = claimed(s.Claim(t.Context(), claimAt(scope("k"), "o1", "fp", t0)))
		var oe *sqlstore.OpError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, "claim", oe.Op)
		require.True(t, strings.HasPrefix(err.Error(), "sqlstore: claim: "), err.Error())
		_, err = s.Get(t.Context(), scope("k"))
		require.ErrorAs(t, err, &oe)
		require.False(t, errors.Is(err, idempotency.ErrNotFound))
	})
}

func TestClaimLifecycle(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		sc := scope("key-1")

		// Absent: the first claim creates generation 1.
		rec, ok, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp1", t0)))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, idempotency.InProgress, rec.State)
		require.Equal(t, sc, rec.Scope)
		require.Equal(t, "A", rec.Owner)
		require.EqualValues(t, 1, rec.Generation)
		require.Equal(t, "fp1", rec.Fingerprint)
		require.Equal(t, 1, rec.FingerprintVersion)
		require.Equal(t, []byte("req-A"), rec.Request)
		require.True(t, rec.LeaseUntil.Equal(t0.Add(10*time.Second)), rec.LeaseUntil)
		require.True(t, rec.CreatedAt.Equal(t0))
		require.True(t, rec.UpdatedAt.Equal(t0))
		require.True(t, rec.CompletedAt.IsZero())
		require.Nil(t, rec.Response)
		require.Equal(t, time.UTC, rec.CreatedAt.Location())
		leaseA := rec.Lease()

		// Lease alive: another claimant gets the record, not the lease.
		got, ok, err := claimed(s.Claim(ctx, claimAt(sc, "B", "fp1", t0.Add(5*time.Second))))
		require.NoError(t, err)
		require.False(t, ok)
		require.Equal(t, "A", got.Owner)
		want := rec // the fields ClaimExisting documents; the claim reads no more
		want.Request, want.CreatedAt, want.UpdatedAt = nil, time.Time{}, time.Time{}
		require.Equal(t, want, got)

		// Heartbeat and a recovery point.
		require.NoError(t, s.Heartbeat(ctx, leaseA, t0.Add(20*time.Second)))
		require.NoError(t, s.SetRecoveryPoint(ctx, leaseA, "charged", []byte(`{"charge":"ch_1"}`), t0.Add(6*time.Second)))
		got, err = s.Get(ctx, sc)
		require.NoError(t, err)
		require.True(t, got.LeaseUntil.Equal(t0.Add(20*time.Second)))
		require.True(t, got.UpdatedAt.Equal(t0.Add(6*time.Second)))
		require.Equal(t, "charged", got.RecoveryPoint)
		require.Equal(t, []byte(`{"charge":"ch_1"}`), got.RecoveryData)

		// Still alive at exactly the lease end: no takeover.
		_, ok, err = claimed(s.Claim(ctx, claimAt(sc, "B", "fp1", t0.Add(20*time.Second))))
		require.NoError(t, err)
		require.False(t, ok)

		// Expired but another fingerprint: no takeover.
		_, ok, err = claimed(s.Claim(ctx, claimAt(sc, "B", "fp-other", t0.Add(21*time.Second))))
		require.NoError(t, err)
		require.False(t, ok)

		// Expired, same fingerprint: takeover keeps recovery point, data,
		// request and creation time, and bumps the generation.
		rec, ok, err = claimed(s.Claim(ctx, claimAt(sc, "B", "fp1", t0.Add(21*time.Second))))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, "B", rec.Owner)
		require.EqualValues(t, 2, rec.Generation)
		require.Equal(t, "charged", rec.RecoveryPoint)
		require.Equal(t, []byte(`{"charge":"ch_1"}`), rec.RecoveryData)
		require.Equal(t, []byte("req-A"), rec.Request)
		require.True(t, rec.CreatedAt.Equal(t0))
		require.True(t, rec.LeaseUntil.Equal(t0.Add(31*time.Second)))
		leaseB := rec.Lease()

		// The old owner is fenced out of every write.
		require.ErrorIs(t, s.Heartbeat(ctx, leaseA, t0.Add(time.Minute)), idempotency.ErrLeaseLost)
		require.ErrorIs(t, s.SetRecoveryPoint(ctx, leaseA, "x", nil, t0), idempotency.ErrLeaseLost)
		require.ErrorIs(t, s.Complete(ctx, leaseA, idempotency.Response{Status: 200}, t0), idempotency.ErrLeaseLost)
		require.ErrorIs(t, s.Release(ctx, leaseA), idempotency.ErrLeaseLost)

		// The new owner completes.
		resp := idempotency.Response{
			Status: 201,
			Header: http.Header{"Content-Type": {"application/json"}, "X-Multi": {"a", "b"}},
			Body:   []byte(`{"id":"pay_1"}`),
		}
		done := t0.Add(25 * time.Second)
		require.NoError(t, s.Complete(ctx, leaseB, resp, done))
		got, err = s.Get(ctx, sc)
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, got.State)
		require.Equal(t, &resp, got.Response)
		require.True(t, got.CompletedAt.Equal(done))
		require.True(t, got.UpdatedAt.Equal(done))

		// Completed: writes by the owner now fail too, claims get the replay.
		require.ErrorIs(t, s.Complete(ctx, leaseB, resp, done), idempotency.ErrLeaseLost)
		require.ErrorIs(t, s.Release(ctx, leaseB), idempotency.ErrLeaseLost)
		require.ErrorIs(t, s.Heartbeat(ctx, leaseB, done), idempotency.ErrLeaseLost)
		got, ok, err = claimed(s.Claim(ctx, claimAt(sc, "C", "fp1", done.Add(time.Hour))))
		require.NoError(t, err)
		require.False(t, ok, "exactly at the end of the replay window the record still replays")
		require.Equal(t, idempotency.Completed, got.State)
		require.Equal(t, &resp, got.Response)

		// Past the replay window: a new request (even with another
		// fingerprint) starts over with the next generation, clean.
		c := claimAt(sc, "C", "fp2", done.Add(time.Hour+time.Nanosecond))
		c.FingerprintVersion = 2
		rec, ok, err = claimed(s.Claim(ctx, c))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, idempotency.InProgress, rec.State)
		require.EqualValues(t, 3, rec.Generation)
		require.Equal(t, "fp2", rec.Fingerprint)
		require.Equal(t, 2, rec.FingerprintVersion)
		require.Equal(t, "", rec.RecoveryPoint)
		require.Nil(t, rec.RecoveryData)
		require.Nil(t, rec.Response)
		require.Equal(t, []byte("req-C"), rec.Request)
		require.True(t, rec.CreatedAt.Equal(c.Now))
		require.True(t, rec.CompletedAt.IsZero())

		// Release deletes the record: the next claim is generation 1 again.
		require.NoError(t, s.Release(ctx, rec.Lease()))
		_, err = s.Get(ctx, sc)
		require.ErrorIs(t, err, idempotency.ErrNotFound)
		rec, ok, err = claimed(s.Claim(ctx, claimAt(sc, "D", "fp1", c.Now)))
		require.NoError(t, err)
		require.True(t, ok)
		require.EqualValues(t, 1, rec.Generation)
	})
}

func TestScopeColumnsAllSeparateRecords(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		base := scope("k")
		variants := []idempotency.Scope{base}
		v := base
		v.Principal = "acct_2"
		variants = append(variants, v)
		v = base
		v.Method = "PATCH"
		variants = append(variants, v)
		v = base
		v.Route = "/refunds"
		variants = append(variants, v)
		v = base
		v.Key = "k2"
		variants = append(variants, v)
		for i, sc := range variants {
			rec, ok, err := claimed(s.Claim(ctx, claimAt(sc, "owner", "fp", t0)))
			require.NoError(t, err)
			require.True(t, ok, "variant %d", i)
			require.Equal(t, sc, rec.Scope)
		}
	})
}

func TestNilAndEmptyValuesRoundTrip(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		c := claimAt(scope("nil"), "A", "fp", t0)
		c.Request = nil
		rec, ok, err := claimed(s.Claim(ctx, c))
		require.NoError(t, err)
		require.True(t, ok)
		require.Nil(t, rec.Request)
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 204}, t0))
		got, err := s.Get(ctx, c.Scope)
		require.NoError(t, err)
		require.Equal(t, 204, got.Response.Status)
		require.Nil(t, got.Response.Header, "a nil header stays nil")
		require.Empty(t, got.Response.Body)

		c = claimAt(scope("empty"), "A", "fp", t0)
		rec, _, err = claimed(s.Claim(ctx, c))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 200, Header: http.Header{}}, t0))
		got, err = s.Get(ctx, c.Scope)
		require.NoError(t, err)
		require.Equal(t, http.Header{}, got.Response.Header, "an empty header stays non-nil")
	})
}

func TestAbandonedListsExpiredLeasesOldestFirst(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		// Leases end at t0+10s+i*1s for keys k0..k4; k4 gets completed.
		for i := range 5 {
			now := t0.Add(time.Duration(4-i) * time.Second) // claimed in reverse order
			rec, ok, err := claimed(s.Claim(ctx, claimAt(scope(string(rune('a'+i))), "o", "fp", now)))
			require.NoError(t, err)
			require.True(t, ok)
			if i == 0 {
				require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 200}, now))
			}
		}
		// Leases: b ends t0+13s, c t0+12s, d t0+11s, e t0+10s.
		recs, err := s.Abandoned(ctx, t0.Add(12*time.Second), 10)
		require.NoError(t, err)
		require.Len(t, recs, 2, "strictly before now")
		require.Equal(t, "e", recs[0].Scope.Key)
		require.Equal(t, "d", recs[1].Scope.Key)

		recs, err = s.Abandoned(ctx, t0.Add(time.Hour), 3)
		require.NoError(t, err)
		require.Len(t, recs, 3)
		require.Equal(t, []string{"e", "d", "c"}, []string{recs[0].Scope.Key, recs[1].Scope.Key, recs[2].Scope.Key})

		recs, err = s.Abandoned(ctx, t0.Add(time.Hour), 0)
		require.NoError(t, err)
		require.Empty(t, recs)
	})
}

func TestDeleteBeforeIsBoundedAndSparesRecent(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		horizon := t0.Add(time.Hour)
		// 7 old completed, 1 old in progress with an expired lease, 1 old in
		// progress whose lease reaches past the horizon, 2 recent completed.
		for i := range 7 {
			rec, _, err := claimed(s.Claim(ctx, claimAt(scope("old-done-"+string(rune('a'+i))), "o", "fp", t0)))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 200}, t0.Add(time.Second)))
		}
		_, _, err := claimed(s.Claim(ctx, claimAt(scope("old-abandoned"), "o", "fp", t0)))
		require.NoError(t, err)
		long := claimAt(scope("old-long-lease"), "o", "fp", t0)
		long.LeaseFor = 2 * time.Hour
		_, _, err = claimed(s.Claim(ctx, long))
		require.NoError(t, err)
		for i := range 2 {
			rec, _, err := claimed(s.Claim(ctx, claimAt(scope("recent-"+string(rune('a'+i))), "o", "fp", horizon)))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 200}, horizon))
		}

		var batches []int
		for {
			n, err := s.DeleteBefore(ctx, horizon, 3)
			require.NoError(t, err)
			batches = append(batches, n)
			if n < 3 {
				break
			}
		}
		require.Equal(t, []int{3, 3, 2, 0}[:len(batches)], batches)
		require.Equal(t, []int{3, 3, 2}, batches)

		for _, k := range []string{"old-long-lease", "recent-a", "recent-b"} {
			_, err := s.Get(ctx, scope(k))
			require.NoError(t, err, k)
		}
		for _, k := range []string{"old-abandoned", "old-done-a", "old-done-g"} {
			_, err := s.Get(ctx, scope(k))
			require.ErrorIs(t, err, idempotency.ErrNotFound, k)
		}
		n, err := s.DeleteBefore(ctx, horizon, 0)
		require.NoError(t, err)
		require.Zero(t, n)
	})
}

func TestCanceledContextIsAnError(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.ErrorIs(t, err, context.Canceled)
	})
}

// TestOpenRefusesSQLiteWithoutBusyTimeout: a database opened the way
// database/sql users open one, sql.Open("sqlite", "keys.db"), has no busy
// timeout, so concurrent writers fail with SQLITE_BUSY (503s under load).
// Open refuses it with an error that names SQLiteDSN, and accepts the same
// file opened with SQLiteDSN or with a busy timeout of its own.
func TestOpenRefusesSQLiteWithoutBusyTimeout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys.db")
	for dsn, ok := range map[string]bool{
		path: false,
		"file:" + path + "?_pragma=busy_timeout(5)":                      false,
		sqlstore.SQLiteDSN(path):                                         true,
		"file:" + path + "?_pragma=busy_timeout(2000)&_txlock=immediate": true,
	} {
		db, err := sql.Open("sqlite", dsn)
		require.NoError(t, err)
		_, err = sqlstore.Open(db, sqlstore.SQLite)
		if ok {
			require.NoError(t, err, dsn)
		} else {
			require.ErrorIs(t, err, sqlstore.ErrSQLiteBusyTimeout, dsn)
			require.Contains(t, err.Error(), "SQLiteDSN", dsn)
		}
		require.NoError(t, db.Close())
	}
}

// A busy timeout set with a PRAGMA through the *sql.DB reaches one
// connection of the pool only: Open checks a new connection too, so that
// such a pool (whose concurrent claims fail with SQLITE_BUSY) is
// refused. A DSN with a busy timeout but deferred transactions (no
// _txlock=immediate) is refused too: its units fail with SQLITE_BUSY when
// they read before they write while another connection writes.
func TestOpenChecksEveryConnectionAndImmediateTransactions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys.db")
	db, err := sql.Open("sqlite", path)
	require.NoError(t, err)
	defer db.Close()
	_, err = db.Exec("PRAGMA busy_timeout = 5000")
	require.NoError(t, err)
	_, err = sqlstore.Open(db, sqlstore.SQLite)
	require.ErrorIs(t, err, sqlstore.ErrSQLiteBusyTimeout)

	deferred, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	require.NoError(t, err)
	defer deferred.Close()
	_, err = sqlstore.Open(deferred, sqlstore.SQLite)
	require.ErrorIs(t, err, sqlstore.ErrSQLiteDeferredTx)
	require.Contains(t, err.Error(), "SQLiteDSN")

	good, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	require.NoError(t, err)
	defer good.Close()
	good.SetMaxOpenConns(4)
	_, err = sqlstore.Open(good, sqlstore.SQLite)
	require.NoError(t, err)
	one, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	require.NoError(t, err)
	defer one.Close()
	one.SetMaxOpenConns(1) // one connection: nothing to compare it with, and it must not hang
	_, err = sqlstore.Open(one, sqlstore.SQLite)
	require.NoError(t, err)
}
