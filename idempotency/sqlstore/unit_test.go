package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// createOrders creates the test's business table. Orders with a customer
// that does not exist fail at COMMIT, not at INSERT: on SQLite through a
// deferred foreign key, on PostgreSQL through a deferred constraint trigger
// (DEFERRABLE INITIALLY DEFERRED), so that a test can make a real commit
// fail after every statement of the unit succeeded.
func createOrders(t testing.TB, db *sql.DB, d sqlstore.Dialect) {
	t.Helper()
	if d == sqlstore.MySQL {
		createOrdersMySQL(t, db)
		return
	}
	stmts := []string{
		`CREATE TABLE customers (id TEXT PRIMARY KEY)`,
		`INSERT INTO customers (id) VALUES ('cus_1')`,
	}
	if d == sqlstore.SQLite {
		stmts = append(stmts, `CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL,
			customer TEXT NOT NULL REFERENCES customers (id) DEFERRABLE INITIALLY DEFERRED)`)
	} else {
		stmts = append(stmts,
			`CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL, customer TEXT NOT NULL)`,
			`CREATE FUNCTION orders_check_customer() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				IF NOT EXISTS (SELECT 1 FROM customers WHERE id = NEW.customer) THEN
					RAISE EXCEPTION 'injected commit failure: no customer %', NEW.customer;
				END IF;
				RETURN NULL;
			END $$`,
			`CREATE CONSTRAINT TRIGGER orders_customer_at_commit AFTER INSERT ON orders
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION orders_check_customer()`)
	}
	for _, s := range stmts {
		_, err := db.Exec(s)
		require.NoError(t, err, s)
	}
}

func countOrders(t testing.TB, db *sql.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM orders`).Scan(&n))
	return n
}

func insertOrder(ctx context.Context, id, customer string) error {
	tx, ok := sqlstore.Tx(ctx)
	if !ok {
		return errors.New("no transaction in context")
	}
	q := `INSERT INTO orders (id, amount, customer) VALUES ($1, 100, $2)`
	_, err := tx.ExecContext(ctx, q, id, customer)
	return err
}

func TestTxIsAbsentFromAPlainContext(t *testing.T) {
	tx, ok := sqlstore.Tx(context.Background())
	require.False(t, ok)
	require.Nil(t, tx)
}

func TestUnitCommitsBusinessRowsWithTheResponse(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		rec, ok, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)
		require.True(t, ok)

		u, uctx, err := s.Begin(ctx, rec.Lease())
		require.NoError(t, err)
		require.NoError(t, insertOrder(uctx, "ord_1", "cus_1"))
		require.NoError(t, u.SetRecoveryPoint(uctx, "order_created", []byte("ord_1"), t0.Add(time.Second)))
		require.NoError(t, u.Complete(uctx, idempotency.Response{Status: 201, Body: []byte("created")}, t0.Add(2*time.Second)))

		// Nothing is visible before Commit.
		got, err := s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State)
		require.Equal(t, "", got.RecoveryPoint)

		require.NoError(t, u.Commit())
		require.NoError(t, u.Rollback(), "Rollback after Commit is a no-op")
		require.Equal(t, 1, countOrders(t, db))
		got, err = s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, got.State)
		require.Equal(t, "order_created", got.RecoveryPoint)
		require.Equal(t, []byte("created"), got.Response.Body)
	})
}

func TestUnitRollbackLeavesNeither(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		rec, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)

		u, uctx, err := s.Begin(ctx, rec.Lease())
		require.NoError(t, err)
		require.NoError(t, insertOrder(uctx, "ord_1", "cus_1"))
		require.NoError(t, u.SetRecoveryPoint(uctx, "order_created", nil, t0.Add(time.Second)))
		require.NoError(t, u.Rollback())
		require.Error(t, u.Commit(), "Commit after Rollback fails")

		require.Zero(t, countOrders(t, db))
		got, err := s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State)
		require.Equal(t, "", got.RecoveryPoint)
		// The lease still holds: the owner can release the key.
		require.NoError(t, s.Release(ctx, rec.Lease()))
	})
}

func TestUnitOfALostLeaseCannotCommitItsWrites(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		old, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)
		// A's lease expires; B takes over.
		cur, ok, err := claimed(s.Claim(ctx, claimAt(scope("k"), "B", "fp", t0.Add(time.Minute))))
		require.NoError(t, err)
		require.True(t, ok)

		u, uctx, err := s.Begin(ctx, old.Lease())
		require.NoError(t, err)
		require.NoError(t, insertOrder(uctx, "ord_A", "cus_1"))
		require.ErrorIs(t, u.SetRecoveryPoint(uctx, "x", nil, t0), idempotency.ErrLeaseLost)
		require.ErrorIs(t, u.Complete(uctx, idempotency.Response{Status: 201}, t0), idempotency.ErrLeaseLost)
		require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost, "a fenced unit never commits")
		require.NoError(t, u.Rollback())
		require.Zero(t, countOrders(t, db))
		// The fenced unit rolled back at once: on SQLite it no longer holds
		// the write lock, so the successor's writes go through.
		require.NoError(t, s.Heartbeat(ctx, cur.Lease(), t0.Add(2*time.Minute)))

		// The successor's unit works.
		u, uctx, err = s.Begin(ctx, cur.Lease())
		require.NoError(t, err)
		require.NoError(t, insertOrder(uctx, "ord_B", "cus_1"))
		require.NoError(t, u.Complete(uctx, idempotency.Response{Status: 201}, t0.Add(time.Minute)))
		require.NoError(t, u.Commit())
		require.Equal(t, 1, countOrders(t, db))
	})
}

func TestUnitFailureAtCommitLeavesNeither(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		rec, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)

		u, uctx, err := s.Begin(ctx, rec.Lease())
		require.NoError(t, err)
		require.NoError(t, insertOrder(uctx, "ord_1", "cus_missing"), "the check is deferred to COMMIT")
		require.NoError(t, u.Complete(uctx, idempotency.Response{Status: 201}, t0.Add(time.Second)))
		err = u.Commit()
		var oe *sqlstore.OpError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, "commit", oe.Op)
		require.NoError(t, u.Rollback())

		require.Zero(t, countOrders(t, db))
		got, err := s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State, "the response was not stored")
		require.Nil(t, got.Response)

		// The connection went back to the pool clean: the store still works.
		require.NoError(t, s.Complete(ctx, rec.Lease(), idempotency.Response{Status: 500}, t0.Add(2*time.Second)))
	})
}

// A unit begun with a canceled context fails at its first use: Tx finds no
// transaction, and the unit's writes and its Commit return the *OpError of
// its BEGIN; the record is left as it was.
func TestUnitOfACanceledContextFailsAtItsFirstUse(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _ := newStore(t, b)
		rec, _, err := claimed(s.Claim(t.Context(), claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		u, uctx, err := s.Begin(ctx, rec.Lease())
		require.NoError(t, err)
		tx, ok := sqlstore.Tx(uctx)
		require.False(t, ok)
		require.Nil(t, tx)
		err = u.Complete(t.Context(), idempotency.Response{Status: 201}, t0)
		var oe *sqlstore.OpError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, "begin", oe.Op)
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorIs(t, u.Commit(), context.Canceled)
		require.NoError(t, u.Rollback())
		got, err := s.Get(t.Context(), scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State)
	})
}

// A unit whose transaction never began (a phase that wrote nothing through
// Tx) applies its record write at Commit as one stand-alone conditional
// statement, fenced as any: its recovery point lands, and a unit of a lost
// lease applies nothing and returns idempotency.ErrLeaseLost at Commit.
// Rollback of such a unit applies nothing.
func TestUnitWithoutTransactionWritesAtCommit(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		ctx := t.Context()
		s, _ := newStore(t, b)
		a, _, err := claimed(s.Claim(ctx, claimAt(scope("k"), "A", "fp", t0)))
		require.NoError(t, err)

		u, _, err := s.Begin(ctx, a.Lease())
		require.NoError(t, err)
		require.NoError(t, u.SetRecoveryPoint(ctx, "dropped", nil, t0))
		require.NoError(t, u.Rollback())
		got, err := s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, "", got.RecoveryPoint, "a rolled-back unit applied its write")

		u, _, err = s.Begin(ctx, a.Lease())
		require.NoError(t, err)
		require.NoError(t, u.SetRecoveryPoint(ctx, "order", []byte("o"), t0))
		got, err = s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, "", got.RecoveryPoint, "nothing is visible before Commit")
		require.NoError(t, u.Commit())
		require.Error(t, u.Commit(), "a second Commit fails")
		got, err = s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, "order", got.RecoveryPoint)
		require.Equal(t, "o", string(got.RecoveryData))

		b2, won, err := claimed(s.Claim(ctx, claimAt(scope("k"), "B", "fp", t0.Add(time.Minute))))
		require.NoError(t, err)
		require.True(t, won)
		u, _, err = s.Begin(ctx, a.Lease())
		require.NoError(t, err)
		require.NoError(t, u.Complete(ctx, idempotency.Response{Status: 201}, t0.Add(time.Minute)))
		require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost)
		got, err = s.Get(ctx, scope("k"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State)
		require.Equal(t, b2.Owner, got.Owner)
	})
}
