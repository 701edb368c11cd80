package sqlstore_test

import (
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"
)

// createOrdersMySQL is createOrders on MySQL, which has no deferred
// constraint: the orders table takes any customer, and the test pool's
// connections check at each COMMIT that every order's customer exists,
// killing their own session when one does not (see mysqlCommitCheck), so
// that the COMMIT really fails and the server rolls the transaction back.
func createOrdersMySQL(t testing.TB, db *sql.DB) {
	t.Helper()
	for _, s := range []string{
		`CREATE TABLE customers (id VARCHAR(255) PRIMARY KEY)`,
		`INSERT INTO customers (id) VALUES ('cus_1')`,
		`CREATE TABLE orders (id VARCHAR(255) PRIMARY KEY, amount INTEGER NOT NULL, customer TEXT NOT NULL)`,
	} {
		_, err := db.Exec(s)
		require.NoError(t, err, s)
	}
	checkAtCommit(t, db, `SELECT COUNT(*) FROM orders o LEFT JOIN customers c ON c.id = o.customer WHERE c.id IS NULL`)
}
