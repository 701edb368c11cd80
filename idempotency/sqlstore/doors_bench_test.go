package sqlstore_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// BenchmarkDoors compares, on SQLite and on PostgreSQL in the same run, the
// function door with the HTTP door for the same work at 1 caller, each
// with a distinct key: http, a guarded POST through Wrap (httptest
// recorder, no network) whose handler writes a 36-byte JSON body; do, a
// call of Do with the same 52-byte payload whose function returns that
// body. Both make the same store calls (a claim and a completion outside
// any unit); they are interleaved as BenchmarkPostgres's variants are.
// do-ratio is http's time over do's: above 1, the function door is the
// faster.
//
//	SAFERETRY_PG_DSN=... go test -run '^$' -bench 'BenchmarkDoors$' -benchtime 3000x -count 3 ./idempotency/sqlstore/
func BenchmarkDoors(b *testing.B) {
	for _, be := range backends[:2] { // SQLite, PostgreSQL
		b.Run(be.name, func(b *testing.B) {
			s, _ := newStore(b, be)
			const payload = `{"amount":4200,"currency":"eur","customer":"cus_1"}`
			out := []byte(`{"id":"pay_1","status":"succeeded"}`)
			mw := idempotency.New(s,
				idempotency.WithPrincipal(func(*http.Request) (string, error) { return "bench", nil }),
				idempotency.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
			h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(out)
			}))
			fn := func(context.Context, *idempotency.Run) ([]byte, error) { return out, nil }
			interleave(b, 1, []benchVariant{
				{"do", func(b *testing.B) {
					res, err := mw.Do(b.Context(), idempotency.Call{Principal: "bench",
						Operation: "POST /payments", Key: "bench-" + randHex(16),
						Payload: []byte(payload)}, fn)
					if err != nil || res.Replayed {
						b.Errorf("Do: %v (replayed %v)", err, res.Replayed)
					}
				}},
				{"http", func(b *testing.B) {
					req := httptest.NewRequest(http.MethodPost, "/payments",
						strings.NewReader(payload))
					req.Header.Set("Content-Type", "application/json")
					req.Header.Set("Idempotency-Key", "bench-"+randHex(16))
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, req)
					if rec.Code != http.StatusCreated {
						b.Errorf("status %d: %s", rec.Code, rec.Body)
					}
				}},
			})
		})
	}
	require.Equal(b, sqlstore.Postgres, backends[1].dialect)
}
