package sqlstore_test

import (
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// BenchmarkMySQL compares, on one fresh MySQL (MariaDB in CI) database in
// the same run, at 1 and 16 concurrent callers, the middleware (httptest
// recorder, no network; a handler that writes nothing to the database)
// with the smallest hand-written code that does the same on a table of its
// own, for the three answers a guarded request gets:
//
//   - fresh: a new key. Hand-written: an INSERT claim (a duplicate key
//     means taken) and a conditional UPDATE storing the response, the two
//     statements the Store sends;
//   - replay: a completed key. Hand-written: the INSERT, which fails on the
//     duplicate, and a SELECT of the stored response;
//   - conflict: a key in progress (409). Hand-written: the same two.
//
// The hand-written table has the store's two secondary indexes (records in
// progress by lease, for finding abandoned claims; completed records by
// completion time, for cleanup) and its statements are prepared, as the
// Store's are. Each sub-benchmark runs the
// two variants interleaved (see interleave) and reports
// middleware-ratio, the hand-written time over the middleware's: the
// middleware's share of the hand-written loop's requests per second
// (1e9 / ns/op each). Run (repeat with -count to see the spread):
//
//	SAFERETRY_MYSQL_DSN='root@tcp(127.0.0.1:3306)/test' go test -run '^$' \
//		-bench 'BenchmarkMySQL$' -benchtime 3000x ./idempotency/sqlstore/
func BenchmarkMySQL(b *testing.B) {
	db, err := sql.Open("mysql", mysqlDatabaseDSN(b))
	require.NoError(b, err)
	b.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	s, err := sqlstore.Open(db, sqlstore.MySQL)
	require.NoError(b, err)
	require.NoError(b, s.Migrate(b.Context()))
	for _, stmt := range []string{
		`CREATE TABLE bench_plain (id VARBINARY(64) PRIMARY KEY, owner VARBINARY(64) NOT NULL,
			state SMALLINT NOT NULL, lease_until BIGINT NOT NULL, status INTEGER, body LONGBLOB,
			created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL,
			INDEX bench_plain_pending_idx (state, lease_until),
			INDEX bench_plain_done_idx (state, updated_at)) ENGINE = InnoDB`,
	} {
		_, err := db.Exec(stmt)
		require.NoError(b, err)
	}
	prepare := func(q string) *sql.Stmt {
		st, err := db.Prepare(q)
		require.NoError(b, err)
		b.Cleanup(func() { _ = st.Close() })
		return st
	}
	claim := prepare(`INSERT INTO bench_plain
		(id, owner, state, lease_until, created_at, updated_at) VALUES (?, ?, 1, ?, ?, ?)`)
	complete := prepare(`UPDATE bench_plain SET state = 2, status = 201, body = ?, updated_at = ?
		WHERE id = ? AND owner = ? AND state = 1`)
	read := prepare(`SELECT state, status, body FROM bench_plain WHERE id = ?`)

	const reqBody = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
	respBody := []byte(`{"id":"pay_1","status":"succeeded"}`)
	key := func() string { return "bench-" + randHex(16) }
	block := make(chan struct{}) // the handlers of the busy- keys return at the end
	var blocked sync.WaitGroup
	b.Cleanup(func() {
		close(block)
		blocked.Wait()
	})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.Header.Get("Idempotency-Key"), "busy-") {
			<-block
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(respBody)
	})
	mw := idempotency.New(s,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
		idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))).Wrap(h)
	serve := func(b *testing.B, k string, want int) {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", k)
		rec := httptest.NewRecorder()
		mw.ServeHTTP(rec, req)
		if rec.Code != want {
			b.Errorf("status %d, want %d: %s", rec.Code, want, rec.Body)
		}
	}
	handClaim := func(b *testing.B, id string) bool {
		now := time.Now().UnixNano()
		_, err := claim.ExecContext(b.Context(), id, "owner", now+int64(30*time.Second), now, now)
		return err == nil
	}
	handRead := func(b *testing.B, id string, state int) {
		var st int
		var status sql.NullInt64
		var body []byte
		err := read.QueryRowContext(b.Context(), id).Scan(&st, &status, &body)
		if err != nil || st != state {
			b.Errorf("read %q: state %d, %v", id, st, err)
		}
	}

	// The keys that replay and conflict use, made once: completed ones, and
	// ones whose handler runs for the whole benchmark.
	const pool = 256
	done, busy := make([]string, pool), make([]string, pool)
	for i := range pool {
		done[i], busy[i] = key(), "busy-"+key()
		serve(b, done[i], http.StatusCreated)
		blocked.Go(func() { serve(b, busy[i], http.StatusCreated) })
		sc := idempotency.Scope{Principal: "bench", Method: http.MethodPost, Route: "/payments",
			Key: busy[i]}
		for {
			if _, err := s.Get(b.Context(), sc); err == nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		require.True(b, handClaim(b, done[i]))
		_, err = complete.ExecContext(b.Context(), respBody, time.Now().UnixNano(), done[i],
			"owner")
		require.NoError(b, err)
		require.True(b, handClaim(b, busy[i]))
	}
	var next atomic.Int64
	pick := func(keys []string) string { return keys[next.Add(1)%pool] }

	scenarios := []struct {
		name     string
		variants []benchVariant
	}{
		{"fresh", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, key(), http.StatusCreated) }},
			{"handwritten", func(b *testing.B) {
				id := key()
				if !handClaim(b, id) {
					b.Error("claim of a new key failed")
					return
				}
				res, err := complete.ExecContext(b.Context(), respBody, time.Now().UnixNano(), id,
					"owner")
				if err != nil {
					b.Error(err)
				} else if n, _ := res.RowsAffected(); n != 1 {
					b.Errorf("update changed %d rows", n)
				}
			}},
		}},
		{"replay", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, pick(done), http.StatusCreated) }},
			{"handwritten", func(b *testing.B) {
				id := pick(done)
				if handClaim(b, id) {
					b.Error("claim of a completed key won")
				}
				handRead(b, id, 2)
			}},
		}},
		{"conflict", []benchVariant{
			{"middleware", func(b *testing.B) { serve(b, pick(busy), http.StatusConflict) }},
			{"handwritten", func(b *testing.B) {
				id := pick(busy)
				if handClaim(b, id) {
					b.Error("claim of a key in progress won")
				}
				handRead(b, id, 1)
			}},
		}},
	}
	for _, sc := range scenarios {
		for _, conc := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/c%d", sc.name, conc), func(b *testing.B) {
				interleave(b, conc, sc.variants)
			})
		}
	}
}
