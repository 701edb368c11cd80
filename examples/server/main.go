// Command server is a payments API whose POST /charges is guarded by the
// idempotency middleware on an embedded SQLite file: the server guide's
// sample (docs/SERVER.md), complete.
//
//	go run ./examples/server -addr 127.0.0.1:8080 -db /tmp/payments.db
//	curl -i -H 'Authorization: Bearer acct_1' -H 'Idempotency-Key: order-42' \
//	  -d '{"amount":4200}' http://127.0.0.1:8080/charges # again: the same answer, replayed
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	_ "modernc.org/sqlite" // the driver "sqlite"; PostgreSQL: github.com/jackc/pgx/v5/stdlib

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "address to listen on")
	path := flag.String("db", "payments.db", "SQLite database file, created if missing")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	if err := serve(ctx, ln, *path); err != nil {
		log.Fatal(err)
	}
}

// serve serves the payments API on ln until ctx ends, then lets the requests
// in flight finish.
func serve(ctx context.Context, ln net.Listener, path string) error {
	// SQLiteDSN: WAL, a busy timeout and BEGIN IMMEDIATE, without which
	// sqlstore.Open refuses SQLite. PostgreSQL: sql.Open("pgx", dsn).
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	if err != nil {
		return err
	}
	defer db.Close()
	// More than one connection: a request's transaction holds one while
	// its lease's heartbeat and other requests need others.
	db.SetMaxOpenConns(8)
	// Open checks that the database is the dialect named, safely set up.
	store, err := sqlstore.Open(db, sqlstore.SQLite) // or sqlstore.Postgres
	if err != nil {
		return err
	}
	// Migrate creates the table of idempotency records if it is missing.
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	// The business table, created at start-up, never during a request.
	if _, err := db.ExecContext(ctx, createCharges); err != nil {
		return err
	}
	// New holds the policy (replay window, lease, cleanup horizon) that
	// the Completer and the Reaper below share. WithPrincipal scopes each
	// key to the account your authentication verified, so that no caller
	// gets another's answer; WithKeyRequired refuses a charge without a key.
	mw := idempotency.New(store,
		idempotency.WithPrincipal(authenticate),
		idempotency.WithKeyRequired(true))
	charges := http.HandlerFunc(createCharge)
	mux := http.NewServeMux()
	// Wrap guards the route, inside the mux: the key's scope names the
	// route by its pattern.
	mux.Handle("POST /charges", mw.Wrap(charges))
	// The Completer finishes requests that a crash left unfinished, with
	// the route's handler; the Reaper deletes records past the horizon.
	defer mw.Completer(map[string]http.Handler{"POST /charges": charges}).Start(ctx, 0)()
	defer mw.Reaper().Start(ctx, 0)()

	srv := &http.Server{
		// deadline.Middleware stops work the client no longer waits for
		// (Request-Deadline-Ms) and marks failures retried further down.
		Handler:           deadline.Middleware(mux),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second, // bounds the body the middleware reads
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.Printf("serving POST http://%s/charges", ln.Addr())
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// Shutdown waits for the requests in flight, whose answers are stored.
	shutdown, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return srv.Shutdown(shutdown)
}

const createCharges = `CREATE TABLE IF NOT EXISTS charges (
	id      INTEGER PRIMARY KEY,
	account TEXT    NOT NULL,
	amount  INTEGER NOT NULL
)`

// createCharge records one charge. Its write goes through sqlstore.Tx, the
// transaction in which the middleware stores the answer: the row and the
// answer a retry replays commit together, or neither does. It has no
// *sql.DB to write through: on SQLite the transaction holds the one write
// lock until it commits, so another connection's write would wait for it.
func createCharge(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in struct {
		Amount int64 `json:"amount"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
		// A 4xx is stored and replayed like a success.
		http.Error(w, `want {"amount": cents above 0}`, http.StatusBadRequest)
		return
	}
	account, okAccount := principal(ctx)
	tx, okTx := sqlstore.Tx(ctx)
	if !okAccount || !okTx {
		http.Error(w, "store unavailable", http.StatusServiceUnavailable)
		return
	}
	var id int64
	err := tx.QueryRowContext(ctx,
		"INSERT INTO charges (account, amount) VALUES (?, ?) RETURNING id",
		account, in.Amount).Scan(&id)
	if err != nil {
		// A 5xx rolls the row back with the record and frees the key.
		http.Error(w, "storage failed", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "account": account, "amount": in.Amount})
}

// principal is the account of the request's key, from the library rather
// than the request: a request the Completer resumes after a crash carries
// no credentials (they are never stored), but its record keeps the account.
func principal(ctx context.Context) (string, bool) {
	run, ok := idempotency.FromContext(ctx)
	if !ok {
		return "", false
	}
	return run.Scope.Principal, true
}

// authenticate stands in for your authentication: here a bearer token names
// the account. An error refuses the request: a key is never taken unscoped.
func authenticate(r *http.Request) (string, error) {
	account, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || account == "" {
		return "", fmt.Errorf("no bearer token: %w", idempotency.ErrPrincipalRefused)
	}
	return account, nil
}
