package sqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
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

// idleInTransaction returns the backends of application app that are idle
// in a transaction, as "pid@state_change", with the last statement each
// ran.
func idleInTransaction(t *testing.T, admin *sql.DB, app string) map[string]string {
	t.Helper()
	rows, err := admin.Query(`SELECT pid::text || '@' || state_change::text, query FROM pg_stat_activity
WHERE application_name = $1 AND state = 'idle in transaction'`, app)
	require.NoError(t, err)
	defer func() { _ = rows.Close() }()
	out := map[string]string{}
	for rows.Next() {
		var id, q string
		require.NoError(t, rows.Scan(&id, &q))
		out[id] = strings.Join(strings.Fields(q), " ")
	}
	require.NoError(t, rows.Err())
	return out
}

// Under load (requests whose handlers write through Tx, back to back), the
// library holds no connection idle in a transaction while a handler's phase
// works without writing through Tx: the phase's transaction is never begun,
// and its recovery point is one statement. The test's own connections are
// found by their application_name; a backend idle in a transaction in two
// samples taken 300 ms apart, with the same state_change, has been held
// idle all that time. The control: handlers that wrote through Tx and then
// wait hold their own transactions, and the samples see exactly those.
func TestPostgresNoTransactionIsHeldIdleByTheLibrary(t *testing.T) {
	ctx := t.Context()
	app := "idle_" + randHex(6)
	db, err := sql.Open("pgx", withParam(pgSchemaDSN(t), "application_name", app))
	require.NoError(t, err)
	db.SetMaxOpenConns(40)
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx))
	_, err = db.Exec(`CREATE TABLE notes (id TEXT)`)
	require.NoError(t, err)
	admin, err := sql.Open("pgx", pgDSN(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })

	const slow, holding, loaders = 8, 2, 8
	var working, inside sync.WaitGroup
	working.Add(slow)
	inside.Add(holding)
	release := make(chan struct{})
	note := func(ctx context.Context) error {
		tx, ok := sqlstore.Tx(ctx)
		if !ok {
			return fmt.Errorf("no transaction")
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO notes (id) VALUES ('n')`)
		return err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/slow":
			run, _ := idempotency.FromContext(r.Context())
			if _, err := run.Phase(r.Context(), "work", func(context.Context) ([]byte, error) {
				working.Done()
				<-release
				return []byte("done"), nil
			}); err != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
		case "/hold":
			if note(r.Context()) != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			inside.Done()
			<-release
		}
		if note(r.Context()) != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct", nil })).Wrap(h)
	serve := func(path, key string) int {
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, path, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		mw.ServeHTTP(rec, req)
		return rec.Code
	}

	var (
		wg     sync.WaitGroup
		stop   atomic.Bool
		served atomic.Int64
		failed atomic.Int64
	)
	for i := range loaders {
		wg.Go(func() {
			for n := 0; !stop.Load(); n++ {
				if serve("/fast", fmt.Sprintf("fast-%d-%d", i, n)) == http.StatusCreated {
					served.Add(1)
				} else {
					failed.Add(1)
				}
			}
		})
	}
	codes := make(chan int, slow+holding)
	for i := range slow {
		wg.Go(func() { codes <- serve("/slow", fmt.Sprint("slow-", i)) })
	}
	for i := range holding {
		wg.Go(func() { codes <- serve("/hold", fmt.Sprint("hold-", i)) })
	}
	working.Wait()
	inside.Wait()

	first := idleInTransaction(t, admin, app)
	time.Sleep(300 * time.Millisecond)
	second := idleInTransaction(t, admin, app)
	held := map[string]string{}
	for id, q := range second {
		if _, ok := first[id]; ok {
			held[id] = q
		}
	}
	close(release)
	for range slow + holding {
		require.Equal(t, http.StatusCreated, <-codes)
	}
	stop.Store(true)
	wg.Wait()
	require.Zero(t, failed.Load())
	require.NotZero(t, served.Load(), "the load ran")

	require.Len(t, held, holding, "held idle in a transaction: %v", held)
	for _, q := range held {
		require.True(t, strings.HasPrefix(q, "INSERT INTO notes"), "held after %q, not the handler's own write", q)
	}
}
