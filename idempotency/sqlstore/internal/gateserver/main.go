// Command gateserver is the server process of the cross-process concurrency
// gate (see gate_test.go in package sqlstore): the shared gate server
// (idempotency/internal/gateserver) over the PostgreSQL or MySQL store. Its
// handler records one execution outside any transaction (an external side
// effect that cannot be rolled back) and inserts one business row in the
// store's transaction. Several processes share one database; the test
// counts both.
//
// It prints "listening on HOST:PORT" on stdout once it accepts connections
// and runs until it is killed or receives SIGINT/SIGTERM. The store's table
// and the charges and executions tables must exist (the test creates them).
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"log"
	"time"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/saferetry/saferetry/idempotency/internal/gateserver"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	driver := flag.String("driver", "pgx", `database/sql driver: "pgx" (PostgreSQL) or "mysql"`)
	dsn := flag.String("dsn", "", "data source name for the driver")
	work := flag.Duration("work", 100*time.Millisecond,
		"time the handler spends after inserting its row, inside the transaction")
	conns := flag.Int("conns", 10, "max open database connections")
	flag.Parse()
	if err := run(*addr, *driver, *dsn, *work, *conns); err != nil {
		log.Fatal(err)
	}
}

func run(addr, driver, dsn string, work time.Duration, conns int) error {
	if dsn == "" {
		return errors.New("-dsn is required")
	}
	c := charges{dialect: sqlstore.Postgres,
		insertExec:   `INSERT INTO executions (idem_key, pid) VALUES ($1, $2)`,
		insertCharge: `INSERT INTO charges (idem_key, pid) VALUES ($1, $2) RETURNING id`}
	if driver == "mysql" {
		c = charges{dialect: sqlstore.MySQL,
			insertExec:   `INSERT INTO executions (idem_key, pid) VALUES (?, ?)`,
			insertCharge: `INSERT INTO charges (idem_key, pid) VALUES (?, ?)`} // no RETURNING: LastInsertId
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	c.db = db
	store, err := sqlstore.Open(db, c.dialect)
	if err != nil {
		return err
	}
	return gateserver.Run(addr, store, c, work)
}

// charges writes the gate's rows: an execution in autocommit, a charge in
// the request's transaction.
type charges struct {
	db                       *sql.DB
	dialect                  sqlstore.Dialect
	insertExec, insertCharge string
}

func (c charges) Execution(ctx context.Context, key string, pid int) error {
	_, err := c.db.ExecContext(ctx, c.insertExec, key, pid)
	return err
}

func (c charges) Charge(ctx context.Context, key string, pid int) (int64, error) {
	tx, ok := sqlstore.Tx(ctx)
	if !ok {
		return 0, errors.New("no transaction")
	}
	if c.dialect == sqlstore.MySQL {
		res, err := tx.ExecContext(ctx, c.insertCharge, key, pid)
		if err != nil {
			return 0, err
		}
		return res.LastInsertId()
	}
	var id int64
	err := tx.QueryRowContext(ctx, c.insertCharge, key, pid).Scan(&id)
	return id, err
}
