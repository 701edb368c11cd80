//go:build unix

// Command phaseserver is the server process of the crash-recovery tests
// (crash_test.go in package sqlstore): the shared phase server
// (idempotency/internal/phaseserver, which documents the request, the
// phases and the flags -processor, -lease, -crash, -completer and -auth)
// over the SQL store (SQLite, PostgreSQL or MySQL). The order phase inserts
// the order in its own transaction, and the receipt is inserted in the
// request's transaction, which commits with the stored response.
//
// It migrates the store's table and creates its business tables, prints
// "listening on HOST:PORT" on stdout once it accepts connections, and runs
// until it is killed or receives SIGINT/SIGTERM.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"log"
	"os"
	"os/signal"
	"regexp"
	"syscall"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/internal/phaseserver"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

func main() {
	driver := flag.String("driver", "sqlite", `database/sql driver: "sqlite", "pgx" or "mysql"`)
	dsn := flag.String("dsn", "", "data source name (for sqlite, a file path)")
	cfg := phaseserver.Flags()
	flag.Parse()
	if err := run(*driver, *dsn, *cfg); err != nil {
		log.Fatal(err)
	}
}

func run(driver, dsn string, cfg phaseserver.Config) error {
	if dsn == "" || cfg.Processor == "" {
		return errors.New("-dsn and -processor are required")
	}
	dialect, bind := sqlstore.Postgres, func(q string) string { return q }
	switch driver {
	case "sqlite":
		dialect, dsn = sqlstore.SQLite, sqlstore.SQLiteDSN(dsn)
	case "mysql":
		dialect = sqlstore.MySQL
		bind = func(q string) string { return placeholder.ReplaceAllString(q, "?") }
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(8)
	store, err := sqlstore.Open(db, dialect)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	for _, ddl := range []string{
		`CREATE TABLE IF NOT EXISTS orders (id VARCHAR(64) PRIMARY KEY, idem_key TEXT NOT NULL,` +
			` amount BIGINT NOT NULL, pid INTEGER NOT NULL)`,
		`CREATE TABLE IF NOT EXISTS receipts (order_id VARCHAR(64) PRIMARY KEY,` +
			` charge TEXT NOT NULL, pid INTEGER NOT NULL)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return err
		}
	}
	return phaseserver.Serve(ctx, store, writes{bind: bind}, cfg)
}

// placeholder matches the $N placeholders the queries are written with;
// MySQL's are ?, bound in the order they appear.
var placeholder = regexp.MustCompile(`\$[0-9]+`)

// writes inserts the order in the phase's transaction and the receipt in
// the request's.
type writes struct {
	bind func(string) string // the driver's placeholders for $N
}

func (w writes) Order(ctx context.Context, run *idempotency.Run, id string, amount int64,
	pid int) ([]byte, error) {
	tx, ok := sqlstore.Tx(ctx) // the phase's transaction
	if !ok {
		return nil, errors.New("no transaction")
	}
	insert := w.bind(`INSERT INTO orders (id, idem_key, amount, pid) VALUES ($1, $2, $3, $4)`)
	_, err := tx.ExecContext(ctx, insert, id, run.Scope.Key, amount, pid)
	return []byte(id), err
}

func (w writes) Receipt(ctx context.Context, _ *idempotency.Run, order, charge []byte,
	pid int) error {
	tx, ok := sqlstore.Tx(ctx) // the request's transaction: commits with the response
	if !ok {
		return errors.New("no transaction")
	}
	insert := w.bind(`INSERT INTO receipts (order_id, charge, pid) VALUES ($1, $2, $3)`)
	_, err := tx.ExecContext(ctx, insert, string(order), string(charge), pid)
	return err
}
