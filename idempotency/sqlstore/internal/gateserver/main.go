// Command gateserver is the server process of the cross-process concurrency
// gate (see gate_test.go in package sqlstore): POST /charges guarded by the
// idempotency middleware over the PostgreSQL or MySQL store, with a handler that
// records one execution outside any transaction (an external side effect
// that cannot be rolled back) and inserts one business row in the store's
// transaction. Several processes share one database; the test counts both.
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
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/saferetry/saferetry/idempotency"
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
	dialect, insertExec, insertCharge := sqlstore.Postgres,
		`INSERT INTO executions (idem_key, pid) VALUES ($1, $2)`,
		`INSERT INTO charges (idem_key, pid) VALUES ($1, $2) RETURNING id`
	if driver == "mysql" {
		dialect, insertExec, insertCharge = sqlstore.MySQL,
			`INSERT INTO executions (idem_key, pid) VALUES (?, ?)`,
			`INSERT INTO charges (idem_key, pid) VALUES (?, ?)` // no RETURNING: LastInsertId
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	store, err := sqlstore.Open(db, dialect)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "gate", nil }),
		idempotency.WithLogger(logger))

	pid := os.Getpid()
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		run, _ := idempotency.FromContext(r.Context())
		// An external side effect, outside the transaction (like a call to
		// a payment processor): it cannot be rolled back, so the gate
		// counts these to prove the handler ran once.
		if _, err := db.ExecContext(r.Context(), insertExec, run.Scope.Key, pid); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		var id int64
		var err error
		if dialect == sqlstore.MySQL {
			var res sql.Result
			res, err = tx.ExecContext(r.Context(), insertCharge, run.Scope.Key, pid)
			if err == nil {
				id, err = res.LastInsertId()
			}
		} else {
			err = tx.QueryRowContext(r.Context(), insertCharge, run.Scope.Key, pid).Scan(&id)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		select { // the side effect takes a while: others arrive meanwhile
		case <-time.After(work):
		case <-r.Context().Done():
			http.Error(w, "canceled", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"charge":%d,"pid":%d}`, id, pid)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("listening on %s\n", ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	}
}
