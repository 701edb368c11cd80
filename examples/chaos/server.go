package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // PostgreSQL driver "pgx"
	"github.com/redis/go-redis/v9"
	_ "modernc.org/sqlite" // SQLite driver "sqlite"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/keygen"
)

// backend is the database of the payments API: the idempotency records and
// the business table "payments", whose rows are the side effects counted at
// the end. With the memory store both live in the process: the payments in
// a ledger that the memory store's units append to as they commit.
type backend struct {
	db      *sql.DB // nil for the memory store
	dialect sqlstore.Dialect
	store   idempotency.Store
	ledger  *ledger               // the memory store's payments
	redis   redis.UniversalClient // the Redis stores' payments (redis.go)
	prefix  string                // the run's Redis key prefix
	where   string                // for the report: the SQLite file or the PostgreSQL schema
	close   func()                // drops what openBackend created
}

// ledger is the payments table of the memory store: rows appended under
// the store's lock when the unit they belong to commits.
type ledger struct {
	mu   sync.Mutex
	next int64
	rows map[string][]int64 // idempotency key -> payment ids
}

func (l *ledger) id() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.next++
	return l.next
}

func (l *ledger) add(key string, id int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rows[key] = append(l.rows[key], id)
}

// openBackend opens a fresh database: a SQLite file in a new temporary
// directory, or a new schema in the PostgreSQL database of dsn, so that runs
// never see each other's rows. close deletes the temporary directory or drops
// the schema, unless keep is set.
func openBackend(ctx context.Context, kind, dsn string, keep bool) (*backend, error) {
	switch kind {
	case "memory":
		return &backend{store: memstore.New(), ledger: &ledger{rows: map[string][]int64{}},
			where: "in this process", close: func() {}}, nil
	case "sqlite":
		return openSQLite(ctx, dsn, keep)
	case "postgres":
		return openPostgres(ctx, dsn, keep)
	case "mysql":
		return openMySQL(ctx, dsn, keep)
	case "redis", "redis-cluster":
		return openRedis(ctx, dsn, kind == "redis-cluster", keep)
	}
	return nil, fmt.Errorf("unknown store %q (want memory, sqlite, postgres, mysql, redis or redis-cluster)", kind)
}

func openSQLite(ctx context.Context, path string, keep bool) (*backend, error) {
	cleanup := func() {}
	where := path
	if path != "" {
		if _, err := os.Stat(path); err == nil {
			return nil, fmt.Errorf("%s exists: -dsn for sqlite must name a new file, so that the run counts only its own rows", path)
		}
	}
	if path == "" {
		dir, err := os.MkdirTemp("", "saferetry-chaos-")
		if err != nil {
			return nil, err
		}
		path = filepath.Join(dir, "payments.db")
		where = path + ", kept by -keep"
		if !keep {
			cleanup = func() { _ = os.RemoveAll(dir) }
			where = path + ", deleted at exit; -keep keeps it"
		}
	}
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	if err != nil {
		cleanup()
		return nil, err
	}
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	b := &backend{db: db, dialect: sqlstore.SQLite, where: where,
		close: func() { _ = db.Close(); cleanup() }}
	if err := b.migrate(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id           INTEGER PRIMARY KEY AUTOINCREMENT,
		idem_key     TEXT    NOT NULL,
		account      TEXT    NOT NULL,
		order_id     TEXT    NOT NULL,
		amount_cents INTEGER NOT NULL,
		created_at   INTEGER NOT NULL
	)`); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

func openPostgres(ctx context.Context, dsn string, keep bool) (*backend, error) {
	if dsn == "" {
		return nil, errors.New("-store postgres needs -dsn (or SAFERETRY_PG_DSN), e.g. postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	schema := "chaos_" + hex.EncodeToString(rnd[:])
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, err
	}
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+schema); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	where := "schema " + schema + ", dropped at exit; -keep keeps it"
	if keep {
		where = "schema " + schema + ", kept by -keep"
	}
	dropSchema := func() {
		if keep {
			_ = admin.Close()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = admin.ExecContext(ctx, "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close()
	}
	db, err := sql.Open("pgx", withSearchPath(dsn, schema))
	if err != nil {
		dropSchema()
		return nil, err
	}
	// Keep every connection open and open them now: a connection set up
	// while a request waits costs tens of milliseconds, and a request whose
	// client gave up cancels the set-up, so a cold pool never warms.
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	b := &backend{db: db, dialect: sqlstore.Postgres, where: where,
		close: func() { _ = db.Close(); dropSchema() }}
	if err := b.migrate(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id           BIGSERIAL PRIMARY KEY,
		idem_key     TEXT   NOT NULL,
		account      TEXT   NOT NULL,
		order_id     TEXT   NOT NULL,
		amount_cents BIGINT NOT NULL,
		created_at   BIGINT NOT NULL
	)`); err != nil {
		b.close()
		return nil, err
	}
	if err := warm(ctx, db, 32); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

// warm opens n pool connections at once, so that they stay idle in the pool.
func warm(ctx context.Context, db *sql.DB, n int) error {
	conns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			return fmt.Errorf("postgres: %w", err)
		}
		conns = append(conns, c)
	}
	return nil
}

// withSearchPath adds search_path=schema to a PostgreSQL DSN in URL or
// keyword/value form.
func withSearchPath(dsn, schema string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " search_path=" + schema
}

// migrate creates the idempotency table (sqlstore.Migrate) and the
// business table. The payments table deliberately has no unique constraint
// on the key: de-duplication is the middleware's job, and the run counts
// whatever slips through.
func (b *backend) migrate(ctx context.Context, ddl string) error {
	st, err := sqlstore.Open(b.db, b.dialect)
	if err != nil {
		return err
	}
	if err := st.Migrate(ctx); err != nil {
		return err
	}
	b.store = st
	if _, err := b.db.ExecContext(ctx, ddl); err != nil {
		return fmt.Errorf("creating the payments table: %w", err)
	}
	return nil
}

// sideEffects returns the number of payments rows per idempotency key.
func (b *backend) sideEffects(ctx context.Context) (map[string][]int64, error) {
	if b.ledger != nil {
		b.ledger.mu.Lock()
		defer b.ledger.mu.Unlock()
		return maps.Clone(b.ledger.rows), nil
	}
	if b.redis != nil {
		return b.redisSideEffects(ctx)
	}
	rows, err := b.db.QueryContext(ctx, "SELECT idem_key, id FROM payments ORDER BY id")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string][]int64{}
	for rows.Next() {
		var key string
		var id int64
		if err := rows.Scan(&key, &id); err != nil {
			return nil, err
		}
		out[key] = append(out[key], id)
	}
	return out, rows.Err()
}

// paymentRequest is the JSON body of POST /payments.
type paymentRequest struct {
	Order       string `json:"order"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// paymentResponse is the JSON body of a 201 answer.
type paymentResponse struct {
	ID          int64  `json:"id"`
	Status      string `json:"status"`
	Order       string `json:"order"`
	AmountCents int64  `json:"amount_cents"`
}

// stallKey marks, on a request context, how long a "slow" request stalls.
type stallKey struct{}

// serverLease is the middleware's lease (idempotency.WithLease): the
// handler takes milliseconds, so 10 s is ample, and a record whose
// execution died is taken over by a retry 10 s later at most.
const serverLease = 10 * time.Second

// api is the payments service: POST /payments inserts one row into
// payments, in the transaction of the idempotency record when the
// middleware provides one (sqlstore.Tx), so that the row and the stored
// response commit together or not at all.
type api struct {
	b      *backend
	insert string
}

func newAPI(b *backend) *api {
	q := "INSERT INTO payments (idem_key, account, order_id, amount_cents, created_at) VALUES (?, ?, ?, ?, ?) RETURNING id"
	if b.dialect == sqlstore.Postgres {
		q = "INSERT INTO payments (idem_key, account, order_id, amount_cents, created_at) VALUES ($1, $2, $3, $4, $5) RETURNING id"
	}
	return &api{b: b, insert: q}
}

var errNoAccount = fmt.Errorf("no bearer token: %w", idempotency.ErrPrincipalRefused)

// account is the authenticated principal: the bearer token names the
// account (a demo stand-in for real authentication).
func account(r *http.Request) (string, error) {
	acct, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || acct == "" {
		return "", errNoAccount
	}
	return acct, nil
}

func (a *api) createPayment(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	acct, err := account(r)
	if err != nil {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	if d, ok := ctx.Value(stallKey{}).(time.Duration); ok {
		// A slow dependency: the client's attempt times out while this
		// execution still runs.
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			http.Error(w, "gave up", http.StatusServiceUnavailable)
			return
		}
	}
	var p paymentRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&p); err != nil || p.Order == "" || p.AmountCents <= 0 {
		http.Error(w, "bad payment", http.StatusBadRequest)
		return
	}
	key, _ := keygen.ParseHeader(r.Header.Values("Idempotency-Key"))
	if a.b.ledger != nil {
		a.createInMemory(w, r, key, p)
		return
	}
	if a.b.redis != nil {
		a.createInRedis(w, r, key, p)
		return
	}
	if a.b.dialect == sqlstore.MySQL {
		a.createInMySQL(w, r, key, acct, p)
		return
	}
	var row *sql.Row
	if tx, ok := sqlstore.Tx(ctx); ok {
		row = tx.QueryRowContext(ctx, a.insert, key, acct, p.Order, p.AmountCents, time.Now().UnixNano())
	} else {
		row = a.b.db.QueryRowContext(ctx, a.insert, key, acct, p.Order, p.AmountCents, time.Now().UnixNano())
	}
	var id int64
	if err := row.Scan(&id); err != nil {
		// 5xx: the middleware rolls the row back with the record and
		// releases the key, so a retry runs again.
		http.Error(w, "storage failed", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(paymentResponse{ID: id, Status: "captured", Order: p.Order, AmountCents: p.AmountCents})
}

// createInMemory is createPayment's write on the memory store: the payment
// is appended to the ledger when the request's unit commits, together with
// the stored response (without the middleware, at once).
func (a *api) createInMemory(w http.ResponseWriter, r *http.Request, key string, p paymentRequest) {
	id := a.b.ledger.id()
	if run, ok := idempotency.FromContext(r.Context()); ok {
		u, _, err := run.Unit(r.Context())
		if err == nil {
			err = memstore.OnCommit(u, func() { a.b.ledger.add(key, id) })
		}
		if err != nil {
			http.Error(w, "storage failed", http.StatusServiceUnavailable)
			return
		}
	} else {
		a.b.ledger.add(key, id)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(paymentResponse{ID: id, Status: "captured", Order: p.Order, AmountCents: p.AmountCents})
}

// handler builds the service's handler chain, outermost first: the fault
// layer, deadline propagation, the router, the idempotency middleware (unless
// unsafe), the payments handler.
func (a *api) handler(f *faultLayer, unsafe bool, logger *slog.Logger, obs idempotency.Observer) http.Handler {
	var payments http.Handler = http.HandlerFunc(a.createPayment)
	if !unsafe {
		mw := idempotency.New(a.b.store,
			idempotency.WithPrincipal(account),
			idempotency.WithLease(serverLease),
			idempotency.WithLogger(logger),
			idempotency.WithObserver(obs))
		payments = mw.Wrap(payments)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", payments)
	f.next = deadline.Middleware(mux)
	return f
}
