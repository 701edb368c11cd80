// Command consumer is the program that .ci/run builds and runs in a module of
// its own, outside the clone, whose go.mod holds the README's install lines:
// a saferetry client with OpenTelemetry metrics sends one payment, on
// loopback, to a handler behind the idempotency middleware over SQLite. The
// first answer is lost after the handler committed (a 503 replaces it); the
// client retries with the same key and gets the stored answer. It exits 0
// when the payment has one row, the retry was a replay, and both halves'
// metrics counted it; 1 otherwise. It also imports the Redis store and both
// broker adapters, each a module of its own, so that an install line missing
// for any of them fails CI; they need a server, so the program only names
// their constructors.
//
// The directory's name starts with a dot, so the go command of the clone
// ignores it: it builds only as a module of its own.
package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/amqpconsumer"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
	"github.com/saferetry/saferetry/idempotency/redisstore"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/otelsaferetry"
)

// modules names a constructor of each module that needs a server to run:
// the program links them, and a missing replace line fails its build.
var modules = []any{redisstore.New, natsconsumer.New, amqpconsumer.New}

func main() {
	_ = modules
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "saferetry-consumer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(dir, "payments.db")))
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(4)
	store, err := sqlstore.Open(db, sqlstore.SQLite)
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx,
		"CREATE TABLE payments (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)"); err != nil {
		return err
	}

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	otel := otelsaferetry.WithMeterProvider(mp)

	mw := idempotency.New(store, idempotency.WithObserver(otelsaferetry.ServerObserver(otel)))
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusServiceUnavailable)
			return
		}
		if _, err := tx.ExecContext(r.Context(),
			"INSERT INTO payments (amount) VALUES (4200)"); err != nil {
			http.Error(w, "storage failed", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"status":"captured"}`)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(pay))
	// The first answer is lost after the commit: the handler ran, the
	// client sees a 503.
	var served atomic.Int32
	lossy := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Add(1) == 1 {
			mux.ServeHTTP(httptest.NewRecorder(), r)
			http.Error(w, "answer lost", http.StatusServiceUnavailable)
			return
		}
		mux.ServeHTTP(w, r)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: lossy, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()

	client := saferetry.NewClient(otelsaferetry.ClientOptions(otel)...)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost,
		"http://"+ln.Addr().String()+"/payments", strings.NewReader(`{"amount":4200}`))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer acct_1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" {
		return fmt.Errorf("want a replayed 201, got %d %q (Idempotent-Replayed %q)",
			resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	}
	var rows int
	if err := db.QueryRowContext(ctx, "SELECT count(*) FROM payments").Scan(&rows); err != nil {
		return err
	}
	if rows != 1 {
		return fmt.Errorf("%d payment rows for one payment, want 1", rows)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		return err
	}
	retries := sum(rm, otelsaferetry.ClientRetries)
	replays := sum(rm, otelsaferetry.ServerReplays)
	if retries != 1 || replays != 1 {
		return fmt.Errorf("metrics: %s %d, %s %d; want 1 and 1",
			otelsaferetry.ClientRetries, retries, otelsaferetry.ServerReplays, replays)
	}
	fmt.Printf("consumer: one payment row, the retry replayed the stored 201; %s %d, %s %d\n",
		otelsaferetry.ClientRetries, retries, otelsaferetry.ServerReplays, replays)
	return nil
}

// sum adds up the points of the int64 counter name in rm.
func sum(rm metricdata.ResourceMetrics, name string) int64 {
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
				for _, p := range s.DataPoints {
					n += p.Value
				}
			}
		}
	}
	return n
}
