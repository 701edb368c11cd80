package bench

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// discardWriter is a ResponseWriter that keeps nothing but its header map,
// which the benchmark clears between requests.
type discardWriter struct {
	h    http.Header
	code int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(code int)        { w.code = code }

// created is the guarded handler: it reads the request and answers 201 with
// the 64-byte Body.
func created(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(Body)
}

// steadyRecords is how many records store=memory-steady holds at most.
const steadyRecords = 8192

var mwPayload = []byte(`{"order":"42","amount_cents":1999,"currency":"EUR","note":"bench"}`)

// openSQLStore opens a fresh SQL store for one sub-benchmark and drops it
// afterwards.
func openSQLStore(b *testing.B, dialect sqlstore.Dialect) idempotency.Store {
	var (
		db    *sql.DB
		err   error
		table = sqlstore.DefaultTable
	)
	switch dialect {
	case sqlstore.SQLite:
		db, err = sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(b.TempDir(), "idem.db")))
	default:
		dsn := os.Getenv("SAFERETRY_PG_DSN")
		if dsn == "" {
			b.Skip("SAFERETRY_PG_DSN not set: skipping PostgreSQL benchmarks")
		}
		// Other engineers' tests share the database: use a table of our own.
		table = fmt.Sprintf("bench_idem_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
		db, err = sql.Open("pgx", dsn)
	}
	if err != nil {
		b.Fatal(err)
	}
	st, err := sqlstore.Open(db, dialect, sqlstore.WithTable(table))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if err := st.Migrate(ctx); err != nil {
		db.Close()
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if dialect == sqlstore.Postgres {
			_, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table)
		}
		db.Close()
	})
	return st
}

// BenchmarkMiddleware is scenario (e): the cost per request of the
// idempotency middleware (default options, a discarding logger) in front of
// a handler, for a POST with a new key each time (claim, run, store the
// response), against the bare handler. No network: ServeHTTP is called
// directly, with a fresh cancellable request context as net/http gives.
// store=memory keeps every record, as a memory store does within its replay
// window, so its heap grows through the run; store=memory-steady deletes
// every record (DeleteBefore, the reaper's call, outside the timer) each
// steadyRecords requests, which leaves the middleware's own cost without
// most of the store's growth. store=postgres runs only when
// SAFERETRY_PG_DSN is set.
func BenchmarkMiddleware(b *testing.B) {
	for _, store := range rotated([]string{"bare", "memory", "memory-steady", "sqlite", "postgres"}) {
		b.Run("store="+store, func(b *testing.B) {
			var h http.Handler = http.HandlerFunc(created)
			var steady *memstore.Store
			// The requests carry no credentials: one shared scope, so that
			// the figures measure the middleware (not a principal function)
			// and stay comparable with earlier runs.
			anon := idempotency.WithAnonymousKeys(true)
			switch store {
			case "memory":
				// No limits: b.N may pass the default's 100,000 records.
				unbounded := memstore.New(memstore.WithMaxRecords(math.MaxInt), memstore.WithMaxBytes(math.MaxInt))
				h = idempotency.New(unbounded, anon, idempotency.WithLogger(DiscardLogger)).Wrap(h)
			case "memory-steady":
				steady = memstore.New()
				h = idempotency.New(steady, anon, idempotency.WithLogger(DiscardLogger)).Wrap(h)
			case "sqlite":
				h = idempotency.New(openSQLStore(b, sqlstore.SQLite), anon, idempotency.WithLogger(DiscardLogger)).Wrap(h)
			case "postgres":
				h = idempotency.New(openSQLStore(b, sqlstore.Postgres), anon, idempotency.WithLogger(DiscardLogger)).Wrap(h)
			}
			u, _ := url.Parse("http://bench.invalid/orders")
			tmpl := http.Request{
				Method: http.MethodPost, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Host: u.Host, RequestURI: u.Path, RemoteAddr: "127.0.0.1:1234", ContentLength: int64(len(mwPayload)),
			}
			prefix := "bench-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
			w := &discardWriter{h: make(http.Header)}
			serve := func(i int) error {
				// As net/http does, each request gets a cancellable context
				// of its own, canceled when the handler returns: a handler
				// that derives contexts from it pays what it would in a
				// server (registering with its parent).
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				r := *tmpl.WithContext(ctx)
				r.Header = http.Header{
					"Content-Type":    {"application/json"},
					"Idempotency-Key": {prefix + strconv.Itoa(i)},
				}
				r.Body = io.NopCloser(bytes.NewReader(mwPayload))
				clear(w.h)
				w.code = 0
				h.ServeHTTP(w, &r)
				if w.code != http.StatusCreated {
					return fmt.Errorf("request %d: status %d", i, w.code)
				}
				return nil
			}
			if err := serve(-1); err != nil { // warm-up (connections, statements)
				b.Fatal(err)
			}
			// kept-B/op: the heap still in use after the run, per request
			// (what the store keeps; a garbage collection before each reading).
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if steady != nil && i%steadyRecords == 0 {
					b.StopTimer()
					if _, err := steady.DeleteBefore(context.Background(), time.Now().Add(time.Hour), math.MaxInt); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				if err := serve(i); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			runtime.GC()
			runtime.ReadMemStats(&after)
			// The store is reachable only through h, whose last use is in
			// the loop: without this, the collection above may free every
			// record and kept-B/op reads 0.
			runtime.KeepAlive(h)
			b.ReportMetric(max(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/float64(b.N), 0), "kept-B/op")
		})
	}
}

// largeBody is the 1 MiB response body of BenchmarkLargeBody.
var largeBody = bytes.Repeat([]byte("0123456789abcdef"), 1<<16)

// BenchmarkLargeBody counts what a 1 MiB response costs in memory (B/op,
// allocs/op; they do not depend on the machine's load) over the memory
// store: bare is the handler alone; fresh a guarded request with a new key
// (the body is captured and stored); replay a guarded request that replays
// a stored body. The handler writes the body in 32 KiB chunks, as io.Copy
// does, without (chunked) and with (sized) a Content-Length header.
//
//	cd bench && go test -run '^$' -bench 'BenchmarkLargeBody$' -benchmem .
func BenchmarkLargeBody(b *testing.B) {
	for _, sized := range []bool{false, true} {
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/octet-stream")
			if sized {
				w.Header().Set("Content-Length", strconv.Itoa(len(largeBody)))
			}
			w.WriteHeader(http.StatusOK)
			for p := largeBody; len(p) > 0; p = p[min(len(p), 32<<10):] {
				_, _ = w.Write(p[:min(len(p), 32<<10)])
			}
		})
		name := "chunked"
		if sized {
			name = "sized"
		}
		for _, mode := range []string{"bare", "fresh", "replay"} {
			b.Run(name+"/"+mode, func(b *testing.B) {
				var served http.Handler = h
				if mode != "bare" {
					store := memstore.New(memstore.WithMaxRecords(math.MaxInt), memstore.WithMaxBytes(math.MaxInt))
					served = idempotency.New(store, idempotency.WithAnonymousKeys(true),
						idempotency.WithLogger(DiscardLogger)).Wrap(h)
				}
				w := &discardWriter{h: make(http.Header)}
				serve := func(key string) {
					r := httptest.NewRequest(http.MethodPost, "/files", bytes.NewReader(mwPayload))
					r.Header.Set("Content-Type", "application/json")
					r.Header.Set("Idempotency-Key", key)
					clear(w.h)
					w.code = 0
					served.ServeHTTP(w, r)
					if w.code != http.StatusOK {
						b.Fatalf("status %d", w.code)
					}
				}
				serve("replayed")
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if mode == "replay" {
						serve("replayed")
					} else {
						serve("k" + strconv.Itoa(i))
					}
				}
			})
		}
	}
}
