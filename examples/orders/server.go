package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// store is the database of the orders API: the idempotency records and
// the orders, in one SQL database.
type store struct {
	db      *sql.DB
	dialect sqlstore.Dialect
	idem    *sqlstore.Store
	drop    func() // removes what the store made (a PostgreSQL schema), nil for none
}

// openStore opens the database driver names ("sqlite": dsn is a file path;
// "pgx": a PostgreSQL DSN, in whose database the store makes a schema of
// its own, dropped by close unless keep is set) and creates its tables.
func openStore(ctx context.Context, driver, dsn string, keep bool) (*store, error) {
	s := &store{dialect: sqlstore.SQLite}
	serial := "INTEGER PRIMARY KEY AUTOINCREMENT"
	switch driver {
	case "sqlite":
		db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(dsn))
		if err != nil {
			return nil, err
		}
		s.db = db
	case "pgx":
		schema, err := newSchema(ctx, dsn, keep)
		if err != nil {
			return nil, err
		}
		db, err := sql.Open("pgx", withSearchPath(dsn, schema.name))
		if err != nil {
			schema.drop()
			return nil, err
		}
		s.db, s.dialect, s.drop = db, sqlstore.Postgres, schema.drop
		serial = "BIGSERIAL PRIMARY KEY"
	default:
		return nil, fmt.Errorf("unknown driver %q: sqlite or pgx", driver)
	}
	s.db.SetMaxOpenConns(16)
	idem, err := sqlstore.Open(s.db, s.dialect)
	if err == nil {
		err = idem.Migrate(ctx)
	}
	if err == nil {
		_, err = s.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id `+serial+
			`, idem_key TEXT NOT NULL, account TEXT NOT NULL, amount BIGINT NOT NULL)`)
	}
	if err != nil {
		s.close()
		return nil, err
	}
	s.idem = idem
	return s, nil
}

func (s *store) close() {
	_ = s.db.Close()
	if s.drop != nil {
		s.drop()
	}
}

// effects returns how many orders the store holds, and how many keys have
// more than one.
func (s *store) effects(ctx context.Context) (orders, duplicated int, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&orders)
	if err == nil {
		err = s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM (SELECT idem_key FROM orders `+
			`GROUP BY account, idem_key HAVING COUNT(*) > 1) d`).Scan(&duplicated)
	}
	return orders, duplicated, err
}

// orderID returns the id of the one order the store holds for key.
func (s *store) orderID(ctx context.Context, account, key string) (int64, error) {
	var id int64
	err := s.db.QueryRowContext(ctx, `SELECT id FROM orders WHERE account = $1 AND idem_key = $2`,
		account, key).Scan(&id)
	return id, err
}

// service is the orders API behind the idempotency middleware, with its
// status monitor at /operations/:
//
//   - POST /orders inserts an order in the request's transaction, which
//     commits with the stored response: the one effect of a request;
//   - POST /charges charges a card at a card processor, an External call
//     under a downstream key that a resume looks up before calling again.
//
// The principal is the X-Account header (a real API takes it from its
// authentication). It counts the requests that reach it.
type service struct {
	st        *store
	mw        *idempotency.Middleware
	handler   http.Handler
	routes    map[string]http.Handler
	processor string
	client    *http.Client
	posts     atomic.Int64 // POST requests that reached the service
	lookups   atomic.Int64 // GET requests to its monitor
}

// serviceConfig is what the service takes besides its store.
type serviceConfig struct {
	secret      []byte        // the monitor's secret, 32 bytes or more
	acceptAfter time.Duration // WithAcceptAfter; 0 for none
	lease       time.Duration // WithLease; 0 for the default
	processor   string        // the card processor's URL, for POST /charges
	logger      *slog.Logger
}

func newService(st *store, cfg serviceConfig) *service {
	s := &service{st: st, processor: cfg.processor,
		client: &http.Client{Timeout: 30 * time.Second}}
	opts := []idempotency.Option{
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil
		}),
		idempotency.WithMonitor("/operations/", cfg.secret),
		idempotency.WithAcceptAfter(cfg.acceptAfter),
		idempotency.WithLogger(cfg.logger),
	}
	if cfg.lease > 0 {
		opts = append(opts, idempotency.WithLease(cfg.lease))
	}
	s.mw = idempotency.New(st.idem, opts...)
	s.routes = map[string]http.Handler{
		"POST /orders":  http.HandlerFunc(s.order),
		"POST /charges": http.HandlerFunc(s.charge),
	}
	mux := http.NewServeMux()
	for route, h := range s.routes {
		mux.Handle(route, s.mw.Wrap(h))
	}
	mux.Handle("GET /operations/", s.mw.Monitor(mux))
	s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			s.posts.Add(1)
		} else if strings.HasPrefix(r.URL.Path, "/operations/") {
			s.lookups.Add(1)
		}
		mux.ServeHTTP(w, r)
	})
	return s
}

type orderBody struct {
	Amount int64 `json:"amount"`
}

// order inserts the order in the request's transaction.
func (s *service) order(w http.ResponseWriter, r *http.Request) {
	run, ok := idempotency.FromContext(r.Context())
	if !ok {
		http.Error(w, "not a guarded request", http.StatusBadRequest)
		return
	}
	var body orderBody
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
		return
	}
	tx, ok := sqlstore.Tx(r.Context())
	if !ok {
		http.Error(w, "no transaction", http.StatusServiceUnavailable)
		return
	}
	var id int64
	err := tx.QueryRowContext(r.Context(), `INSERT INTO orders (idem_key, account, amount) `+
		`VALUES ($1, $2, $3) RETURNING id`, run.Scope.Key, run.Scope.Principal,
		body.Amount).Scan(&id)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%d,"amount":%d}`, id, body.Amount)
}

// charge charges the card processor once, under the downstream key: a
// resume after a crash looks the charge up before calling again.
func (s *service) charge(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	run, ok := idempotency.FromContext(ctx)
	if !ok {
		http.Error(w, "not a guarded request", http.StatusBadRequest)
		return
	}
	body, _ := io.ReadAll(r.Body)
	charge, err := run.External(ctx, "charge",
		func(ctx context.Context, key string) ([]byte, error) {
			out, status, err := s.call(ctx, http.MethodPost, s.processor+"/charges", key, body)
			if err == nil && status != http.StatusCreated {
				err = fmt.Errorf("the processor answered %d", status)
			}
			return out, err
		},
		func(ctx context.Context, key string) ([]byte, bool, error) {
			out, status, err := s.call(ctx, http.MethodGet,
				s.processor+"/charges/"+url.PathEscape(key), "", nil)
			switch {
			case err != nil:
				return nil, false, err
			case status == http.StatusNotFound:
				return nil, false, nil
			case status != http.StatusOK:
				return nil, false, fmt.Errorf("the processor's lookup answered %d", status)
			}
			return out, true, nil
		})
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charge":%q,"pid":%d}`, charge, os.Getpid())
}

func (s *service) call(ctx context.Context, method, u, key string, body []byte) ([]byte, int,
	error) {
	req, err := http.NewRequestWithContext(ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return nil, 0, err
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return out, resp.StatusCode, err
}

// pgSchema is a schema of its own in a PostgreSQL database.
type pgSchema struct {
	name string
	drop func()
}

func newSchema(ctx context.Context, dsn string, keep bool) (pgSchema, error) {
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	name := "orders_" + hex.EncodeToString(rnd[:])
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		return pgSchema{}, err
	}
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+name); err != nil {
		_ = admin.Close()
		return pgSchema{}, fmt.Errorf("postgres: %w", err)
	}
	return pgSchema{name: name, drop: func() {
		if !keep {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = admin.ExecContext(ctx, "DROP SCHEMA "+name+" CASCADE")
		}
		_ = admin.Close()
	}}, nil
}

// withSearchPath adds search_path=schema to a PostgreSQL DSN in URL form.
func withSearchPath(dsn, schema string) string {
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return dsn + " search_path=" + schema
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}
