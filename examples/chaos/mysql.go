package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/go-sql-driver/mysql" // MySQL and MariaDB driver "mysql"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// openMySQL opens a new database chaos_<random> on the MySQL or MariaDB
// server of dsn (a go-sql-driver/mysql DSN whose user may create and drop
// databases), dropped at exit unless keep is set, so that runs never see
// each other's rows.
func openMySQL(ctx context.Context, dsn string, keep bool) (*backend, error) {
	if dsn == "" {
		return nil, errors.New("-store mysql needs -dsn (or SAFERETRY_MYSQL_DSN), " +
			"e.g. root@tcp(127.0.0.1:3306)/test")
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("mysql: %w", err)
	}
	admin, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		return nil, err
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	name := "chaos_" + hex.EncodeToString(rnd[:])
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("mysql: %w", err)
	}
	where := "database " + name + ", dropped at exit; -keep keeps it"
	if keep {
		where = "database " + name + ", kept by -keep"
	}
	drop := func() {
		if !keep {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = admin.ExecContext(ctx, "DROP DATABASE "+name)
		}
		_ = admin.Close()
	}
	cfg.DBName = name
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		drop()
		return nil, err
	}
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	b := &backend{db: db, dialect: sqlstore.MySQL, where: where,
		close: func() { _ = db.Close(); drop() }}
	if err := b.migrate(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id           BIGINT AUTO_INCREMENT PRIMARY KEY,
		idem_key     VARCHAR(255) NOT NULL,
		account      VARCHAR(255) NOT NULL,
		order_id     VARCHAR(255) NOT NULL,
		amount_cents BIGINT       NOT NULL,
		created_at   BIGINT       NOT NULL
	) ENGINE = InnoDB`); err != nil {
		b.close()
		return nil, err
	}
	if err := warm(ctx, db, 32); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

// mysqlInsert is the payment's INSERT on MySQL, which has no RETURNING: the
// row's id is the result's LastInsertId.
const mysqlInsert = `INSERT INTO payments (idem_key, account, order_id, amount_cents, created_at)
VALUES (?, ?, ?, ?, ?)`

// createInMySQL is createPayment's write on MySQL: the payment row, in the
// request's transaction (sqlstore.Tx), and its 201 answer.
func (a *api) createInMySQL(w http.ResponseWriter, r *http.Request, key, acct string,
	p paymentRequest) {
	ctx := r.Context()
	var (
		res sql.Result
		err error
	)
	args := []any{key, acct, p.Order, p.AmountCents, time.Now().UnixNano()}
	if tx, ok := sqlstore.Tx(ctx); ok {
		res, err = tx.ExecContext(ctx, mysqlInsert, args...)
	} else {
		res, err = a.b.db.ExecContext(ctx, mysqlInsert, args...)
	}
	var id int64
	if err == nil {
		id, err = res.LastInsertId()
	}
	if err != nil {
		// 5xx: the middleware rolls the row back with the record and
		// releases the key, so a retry runs again.
		http.Error(w, "storage failed", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(paymentResponse{ID: id, Status: "captured", Order: p.Order,
		AmountCents: p.AmountCents})
}
