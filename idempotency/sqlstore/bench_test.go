package sqlstore_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// BenchmarkPostgres measures the middleware over the PostgreSQL store, with
// a distinct key per request and requests in parallel, against the
// smallest thing that could replace it: a plain INSERT of a row and an
// UPDATE storing the response, on the same database in the same run. The
// ratio of the two ns/op is the cost of the guarantee (claim, transaction,
// fenced completion, fingerprint, buffering). Run:
//
//	SAFERETRY_PG_DSN=... go test -run '^$' -bench BenchmarkPostgres -benchtime 5s ./idempotency/sqlstore/
func BenchmarkPostgres(b *testing.B) {
	db := openPG(b)
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(b, err)
	require.NoError(b, s.Migrate(b.Context()))
	_, err = db.Exec(`CREATE TABLE bench_plain (
		id TEXT PRIMARY KEY, status INTEGER, body BYTEA, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL)`)
	require.NoError(b, err)

	const body = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
	var seq atomic.Int64
	run := fmt.Sprint(time.Now().UnixNano())

	b.Run("middleware", func(b *testing.B) {
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, `{"id":"pay_1","status":"succeeded"}`)
		})
		mw := idempotency.New(s,
			idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
			idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))(h)
		b.SetParallelism(8)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("bench-%s-%d", run, seq.Add(1)))
				rec := httptest.NewRecorder()
				mw.ServeHTTP(rec, req)
				if rec.Code != http.StatusCreated {
					b.Errorf("status %d: %s", rec.Code, rec.Body)
					return
				}
			}
		})
	})

	b.Run("insert_update", func(b *testing.B) {
		b.SetParallelism(8)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			ctx := b.Context()
			for pb.Next() {
				id := fmt.Sprintf("plain-%s-%d", run, seq.Add(1))
				now := time.Now().UnixNano()
				if _, err := db.ExecContext(ctx,
					`INSERT INTO bench_plain (id, created_at, updated_at) VALUES ($1, $2, $2)`, id, now); err != nil {
					b.Error(err)
					return
				}
				if _, err := db.ExecContext(ctx,
					`UPDATE bench_plain SET status = 201, body = $2, updated_at = $3 WHERE id = $1`,
					id, []byte(`{"id":"pay_1","status":"succeeded"}`), time.Now().UnixNano()); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}
