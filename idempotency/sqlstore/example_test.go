package sqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"path/filepath"

	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// Example shows the embedded SQLite store guarding a handler whose business
// write commits in the same transaction as the stored response.
func Example() {
	dir, _ := os.MkdirTemp("", "sqlstore-example")
	defer os.RemoveAll(dir)

	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(dir, "app.db")))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(8) // more than one: see SQLiteDSN

	store, err := sqlstore.Open(db, sqlstore.SQLite)
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE payments (id INTEGER PRIMARY KEY, amount INTEGER)`); err != nil {
		panic(err)
	}

	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := sqlstore.Tx(r.Context()) // commits with the stored response
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO payments (amount) VALUES (4200)`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError) // 5xx: rolled back, key released
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw := idempotency.New(store, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
	http.Handle("POST /payments", mw.Wrap(pay))

	var n int
	_ = db.QueryRow(`SELECT COUNT(*) FROM payments`).Scan(&n)
	fmt.Println("payments:", n)
	// Output: payments: 0
}
