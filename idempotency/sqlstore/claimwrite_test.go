package sqlstore_test

import (
	"bytes"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// countUpdates installs a trigger that counts the UPDATEs of the store's
// rows, and returns a function that reads the count.
func countUpdates(t *testing.T, db *sql.DB, d sqlstore.Dialect) func() int {
	t.Helper()
	stmts := []string{
		`CREATE TABLE row_updates (n INTEGER NOT NULL)`,
		`INSERT INTO row_updates VALUES (0)`,
	}
	if d == sqlstore.Postgres {
		stmts = append(stmts,
			`CREATE FUNCTION count_update() RETURNS trigger LANGUAGE plpgsql AS
			$$ BEGIN UPDATE row_updates SET n = n + 1; RETURN NEW; END $$`,
			`CREATE TRIGGER count_update AFTER UPDATE ON `+sqlstore.DefaultTable+`
			FOR EACH ROW EXECUTE FUNCTION count_update()`)
	} else if d == sqlstore.MySQL {
		stmts = append(stmts, `CREATE TRIGGER count_update AFTER UPDATE ON `+sqlstore.DefaultTable+`
			FOR EACH ROW UPDATE row_updates SET n = n + 1`)
	} else {
		stmts = append(stmts, `CREATE TRIGGER count_update AFTER UPDATE ON `+sqlstore.DefaultTable+`
			BEGIN UPDATE row_updates SET n = n + 1; END`)
	}
	for _, q := range stmts {
		_, err := db.Exec(q)
		require.NoError(t, err, q)
	}
	return func() int { return count(t, db, `SELECT n FROM row_updates`) }
}

// A claim that finds a completed record (a replay) or one in progress (a
// 409) changes no row: it updates nothing, and the record reads back as it
// was. The completed record carries a 1 MiB body, replayed byte for byte.
func TestLosingClaimWritesNothing(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		updates := countUpdates(t, db, b.dialect)
		body := bytes.Repeat([]byte("0123456789abcdef"), 1<<16)

		rec, won, err := claimed(s.Claim(ctx, claimAt(scope("done"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201, Body: body}, t0))
		_, won, err = claimed(s.Claim(ctx, claimAt(scope("busy"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, won)
		before := updates()
		done, err := s.Get(ctx, scope("done"))
		require.NoError(t, err)
		busy, err := s.Get(ctx, scope("busy"))
		require.NoError(t, err)

		for range 3 {
			res, err := s.Claim(ctx, claimAt(scope("done"), "B", "fp", t0.Add(time.Second)))
			require.NoError(t, err)
			require.Equal(t, idempotency.ClaimExisting, res.Outcome)
			require.Equal(t, idempotency.Completed, res.Record.State)
			require.True(t, bytes.Equal(body, res.Record.Response.Body), "the replayed body")
			res, err = s.Claim(ctx, claimAt(scope("busy"), "B", "fp", t0.Add(time.Second)))
			require.NoError(t, err)
			require.Equal(t, idempotency.ClaimExisting, res.Outcome)
			require.Equal(t, "A", res.Record.Owner)
		}
		require.Equal(t, before, updates(), "a losing claim updated a row")
		got, err := s.Get(ctx, scope("done"))
		require.NoError(t, err)
		require.Equal(t, done, got)
		got, err = s.Get(ctx, scope("busy"))
		require.NoError(t, err)
		require.Equal(t, busy, got)
	})
}

// forgeCollision rewrites the scope parts of the one row of the store's
// table to those of other, keeping its digest: the row then stands for a
// record of another scope stored under the digest of the scope that
// created it, as a SHA-256 collision of the two would.
func forgeCollision(t *testing.T, db *sql.DB, d sqlstore.Dialect, other idempotency.Scope) {
	t.Helper()
	q := `UPDATE ` + sqlstore.DefaultTable + ` SET principal = $1, method = $2, route = $3, idem_key = $4`
	if d == sqlstore.SQLite {
		q = `UPDATE ` + sqlstore.DefaultTable + ` SET principal = ?1, method = ?2, route = ?3, idem_key = ?4`
	}
	res, err := db.Exec(q, []byte(other.Principal), []byte(other.Method), []byte(other.Route), []byte(other.Key))
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

// rawRow reads the columns a claim would overwrite, straight from the
// table's one row.
func rawRow(t *testing.T, db *sql.DB) []any {
	t.Helper()
	var (
		state, gen, lease, created, completed int64
		owner, fp                             string
		request, body                         []byte
	)
	require.NoError(t, db.QueryRow(`SELECT state, generation, lease_until, created_at, completed_at, owner,
	fingerprint, request, response_body FROM `+sqlstore.DefaultTable).
		Scan(&state, &gen, &lease, &created, &completed, &owner, &fp, &request, &body))
	return []any{state, gen, lease, created, completed, owner, fp, request, body}
}

// A claim compares the scope's parts before it changes a row: when the row
// under its digest holds another scope (a digest collision, forged here by
// rewriting the row), no claim that would win the row (a takeover of an
// expired lease, a takeover-only claim, a restart of a completed record
// past the replay window) overwrites it. Each fails with an *OpError
// instead, and the row is as it was.
func TestClaimNeverOverwritesAnotherScopesRecord(t *testing.T) {
	victim := idempotency.Scope{Principal: "acct_2", Method: "POST", Route: "/refunds", Key: "other"}
	for _, completed := range []bool{false, true} {
		name := "in_progress"
		if completed {
			name = "completed"
		}
		t.Run(name, func(t *testing.T) {
			forEach(t, func(t *testing.T, b backend) {
				ctx := t.Context()
				s, db := newStore(t, b)
				rec, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
				require.NoError(t, err)
				require.True(t, won)
				if completed {
					require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 201, Body: []byte("victim")}, t0))
				}
				forgeCollision(t, db, b.dialect, victim)
				want := rawRow(t, db)

				later := claimAt(scope("k"), "B", "fp", t0.Add(2*time.Hour)) // lease and replay window over
				takeover := later
				takeover.TakeoverOnly = true
				for _, c := range []idempotency.Claim{later, takeover} {
					_, err := s.Claim(ctx, c)
					var oe *sqlstore.OpError
					require.ErrorAs(t, err, &oe, "takeover only: %v", c.TakeoverOnly)
					require.Equal(t, "claim", oe.Op)
					require.Equal(t, want, rawRow(t, db), "the other scope's row was changed (takeover only: %v)", c.TakeoverOnly)
				}
				_, err = s.Get(ctx, scope("k"))
				require.Error(t, err)
				require.NotErrorIs(t, err, idempotency.ErrNotFound)
			})
		})
	}
}

// A recovery point is any bytes (a phase name is the handler's string): it
// is stored, read back and kept across a takeover as it was, through the
// Store and through a Unit.
func TestRecoveryPointIsBytes(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		for i, point := range []string{"intent:r\xe9sum\xe9", "\x00phase\xff", "charged"} {
			sc := scope(string(rune('a' + i)))
			rec, won, err := claimed(s.Claim(ctx, claimAt(sc, "A", "fp", t0)))
			require.NoError(t, err)
			require.True(t, won)
			require.NoError(t, s.SetRecoveryPoint(ctx, rec.Lease(), point, []byte("data"), t0))
			got, err := s.Get(ctx, sc)
			require.NoError(t, err)
			require.Equal(t, point, got.RecoveryPoint)

			res, err := s.Claim(ctx, claimAt(sc, "B", "fp", t0.Add(time.Minute)))
			require.NoError(t, err)
			require.Equal(t, idempotency.ClaimTakenOver, res.Outcome)
			require.Equal(t, point, res.Record.RecoveryPoint)

			u, _, err := s.Begin(ctx, res.Record.Lease())
			require.NoError(t, err)
			require.NoError(t, u.SetRecoveryPoint(ctx, point+"\x01", nil, t0.Add(time.Minute)))
			require.NoError(t, u.Commit())
			got, err = s.Get(ctx, sc)
			require.NoError(t, err)
			require.Equal(t, point+"\x01", got.RecoveryPoint)
		}
	})
}
