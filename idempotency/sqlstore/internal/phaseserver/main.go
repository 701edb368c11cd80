//go:build unix

// Command phaseserver is the server process of the crash-recovery tests
// (crash_test.go in package sqlstore): POST /payments guarded by the
// idempotency middleware over the SQL store (SQLite, PostgreSQL or MySQL), with the
// worked example of atomic phases: "order" (a phase that inserts the order
// in its own transaction), "charge" (an External phase that calls a card
// processor with the derived downstream key, and looks the charge up on
// resume) and the receipt (inserted in the request's transaction, which
// commits with the stored response).
//
// The test-only flag -crash makes the process SIGKILL itself at a point of
// the first request: "after-order" (the order phase committed, the charge
// not started) or "after-charge" (the processor answered, the charge phase
// not committed). -completer runs a Completer for the route at that
// interval. -auth makes the handler refuse, with 401, a request without
// the X-Account header, as a handler that checks credentials itself does
// (a request the Completer resumes carries none).
//
// It migrates the store's table and creates its business tables, prints
// "listening on HOST:PORT" on stdout once it accepts connections, and runs
// until it is killed or receives SIGINT/SIGTERM.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

type server struct {
	db        *sql.DB
	bind      func(string) string // the driver's placeholders for $N
	processor string
	crash     string
	auth      bool
	pid       int
	client    *http.Client
}

func main() {
	driver := flag.String("driver", "sqlite", `database/sql driver: "sqlite", "pgx" or "mysql"`)
	dsn := flag.String("dsn", "", "data source name (for sqlite, a file path)")
	processor := flag.String("processor", "", "base URL of the card processor")
	lease := flag.Duration("lease", 30*time.Second, "idempotency lease")
	crash := flag.String("crash", "", "kill the process with SIGKILL at this point of the first "+
		`request: "after-order" or "after-charge"`)
	completer := flag.Duration("completer", 0, "run a completer at this interval (0: none)")
	auth := flag.Bool("auth", false, "the handler answers 401 to a request without X-Account")
	flag.Parse()
	if err := run(*driver, *dsn, *processor, *crash, *auth, *lease, *completer); err != nil {
		log.Fatal(err)
	}
}

func run(driver, dsn, processor, crash string, auth bool, lease, completer time.Duration) error {
	if dsn == "" || processor == "" {
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

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	s := &server{db: db, bind: bind, processor: processor, crash: crash, auth: auth,
		pid: os.Getpid(), client: &http.Client{Timeout: 10 * time.Second}}
	pay := http.HandlerFunc(s.pay)
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil
		}),
		idempotency.WithLease(lease), idempotency.WithLogger(logger))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(pay))

	if completer > 0 {
		defer mw.Completer(map[string]http.Handler{"POST /payments": pay}).Start(ctx, completer)()
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("listening on %s\n", ln.Addr())
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

// placeholder matches the $N placeholders the queries are written with;
// MySQL's are ?, bound in the order they appear.
var placeholder = regexp.MustCompile(`\$[0-9]+`)

// die is the test-only trigger: the process kills itself, as a crash would,
// with no deferred function, no rollback and no response.
func (s *server) die(point string) {
	if s.crash == point {
		fmt.Fprintf(os.Stderr, "phaseserver %d: crashing %s\n", s.pid, point)
		_ = syscall.Kill(s.pid, syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

func (s *server) pay(w http.ResponseWriter, r *http.Request) {
	if s.auth && r.Header.Get("X-Account") == "" {
		http.Error(w, "no credentials", http.StatusUnauthorized)
		return
	}
	ctx := r.Context()
	run, ok := idempotency.FromContext(ctx)
	if !ok {
		http.Error(w, "not a guarded request", http.StatusBadRequest)
		return
	}
	body, _ := io.ReadAll(r.Body)
	var amount int64
	if _, err := fmt.Sscanf(string(body), `{"amount":%d}`, &amount); err != nil {
		http.Error(w, "body must be {\"amount\":N}", http.StatusBadRequest)
		return
	}

	order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
		tx, ok := sqlstore.Tx(ctx) // the phase's transaction
		if !ok {
			return nil, errors.New("no transaction")
		}
		id := "ord_" + randHex()
		insert := s.bind(`INSERT INTO orders (id, idem_key, amount, pid) VALUES ($1, $2, $3, $4)`)
		_, err := tx.ExecContext(ctx, insert, id, run.Scope.Key, amount, s.pid)
		return []byte(id), err
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.die("after-order")

	charge, err := run.External(ctx, "charge",
		func(ctx context.Context, key string) ([]byte, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.processor+"/charges",
				bytes.NewReader(fmt.Appendf(nil, `{"order":%q,"amount":%d}`, order, amount)))
			if err != nil {
				return nil, err
			}
			req.Header.Set("Idempotency-Key", key)
			out, status, err := s.do(req)
			if err != nil {
				return nil, err
			}
			if status != http.StatusOK && status != http.StatusCreated {
				return nil, fmt.Errorf("processor answered %d", status)
			}
			s.die("after-charge")
			return out, nil
		},
		func(ctx context.Context, key string) ([]byte, bool, error) {
			u := s.processor + "/charges/" + url.PathEscape(key)
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
			if err != nil {
				return nil, false, err
			}
			out, status, err := s.do(req)
			switch {
			case err != nil:
				return nil, false, err
			case status == http.StatusNotFound:
				return nil, false, nil
			case status == http.StatusOK:
				return out, true, nil
			}
			return nil, false, fmt.Errorf("processor lookup answered %d", status)
		})
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}

	tx, ok := sqlstore.Tx(ctx) // the request's transaction: commits with the response
	if !ok {
		http.Error(w, "no transaction", http.StatusServiceUnavailable)
		return
	}
	insert := s.bind(`INSERT INTO receipts (order_id, charge, pid) VALUES ($1, $2, $3)`)
	if _, err := tx.ExecContext(ctx, insert, string(order), string(charge), s.pid); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%q,"charge":%q,"receipt_pid":%d}`, order, charge, s.pid)
}

func (s *server) do(req *http.Request) ([]byte, int, error) {
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return b, resp.StatusCode, err
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
