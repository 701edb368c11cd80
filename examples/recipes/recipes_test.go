package recipes

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestRecipes runs the three recipes together: the client's charge through
// a proxy that loses the first answer after the handler committed is
// retried with the same key and replayed (one row); the same job message
// delivered twice runs its transfer once.
func TestRecipes(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "recipes.db")))
	require.NoError(t, err)
	defer db.Close()
	db.SetMaxOpenConns(4)
	_, err = db.ExecContext(ctx, "CREATE TABLE charges (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)")
	require.NoError(t, err)

	handler, stop, err := Serve(ctx, db)
	require.NoError(t, err)
	defer stop()
	var served atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Add(1) == 1 { // the answer is lost after the commit
			handler.ServeHTTP(httptest.NewRecorder(), r)
			http.Error(w, "answer lost", http.StatusBadGateway)
			return
		}
		handler.ServeHTTP(w, r)
	}))
	defer srv.Close()

	resp, err := Charge(ctx, srv.URL+"/charges", "42", []byte(`{"amount":4200}`))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"), "the retry gets the stored answer")
	assert.Equal(t, int32(2), served.Load())
	var rows int
	require.NoError(t, db.QueryRowContext(ctx, "SELECT count(*) FROM charges").Scan(&rows))
	assert.Equal(t, 1, rows, "one charge row for a charge retried after its commit")

	store, err := sqlstore.Open(db, sqlstore.SQLite)
	require.NoError(t, err)
	mw := idempotency.New(store)
	var transfers atomic.Int32
	transfer := func(context.Context, *idempotency.Run) ([]byte, error) {
		transfers.Add(1)
		return []byte("done"), nil
	}
	for i, want := range []bool{true, false} {
		ran, err := Transfer(ctx, mw, "msg-7", []byte(`{"cents":100}`), transfer)
		require.NoError(t, err, "delivery %d", i+1)
		assert.Equal(t, want, ran, "delivery %d", i+1)
	}
	assert.Equal(t, int32(1), transfers.Load(), "a message delivered twice transfers once")

	// A key whose transfer is in progress elsewhere: the recipe tells the
	// worker to redeliver later.
	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := Transfer(ctx, mw, "msg-8", nil, func(context.Context, *idempotency.Run) ([]byte, error) {
			close(started)
			<-release
			return nil, nil
		})
		done <- err
	}()
	<-started
	_, err = Transfer(ctx, mw, "msg-8", nil, transfer)
	assert.True(t, errors.Is(err, idempotency.ErrInProgress), "got %v", err)
	close(release)
	require.NoError(t, <-done)
}

// TestDocsQuoteTheRecipes checks that each recipe in README.md and
// docs/CLIENT.md, between its markers, is the code of this package between
// its comments.
func TestDocsQuoteTheRecipes(t *testing.T) {
	code, err := os.ReadFile("recipes.go")
	require.NoError(t, err)
	for _, q := range []struct{ doc, name string }{
		{"README.md", "client"}, {"README.md", "handler"}, {"README.md", "job"},
		{"docs/CLIENT.md", "observers"},
	} {
		doc, err := os.ReadFile("../../" + q.doc)
		require.NoError(t, err)
		_, rest, ok := bytes.Cut(doc, []byte("<!-- begin recipe: "+q.name+" -->\n```go\n"))
		require.True(t, ok, "%s has no recipe %q", q.doc, q.name)
		quoted, _, ok := bytes.Cut(rest, []byte("```\n<!-- end recipe: "+q.name+" -->\n"))
		require.True(t, ok, "%s's recipe %q has no end marker", q.doc, q.name)
		_, rest, ok = bytes.Cut(code, []byte("\t// begin recipe: "+q.name+"\n"))
		require.True(t, ok, "recipes.go has no recipe %q", q.name)
		body, _, ok := bytes.Cut(rest, []byte("\t// end recipe: "+q.name+"\n"))
		require.True(t, ok, "recipes.go's recipe %q has no end", q.name)
		var want strings.Builder
		for _, line := range strings.SplitAfter(string(body), "\n") {
			want.WriteString(strings.TrimPrefix(line, "\t"))
		}
		assert.Equal(t, want.String(), string(quoted), "%s quotes recipe %q", q.doc, q.name)
	}
}

// TestObservers runs the observers of the client guide: a POST answered 503
// then 201 logs two attempts, and the middleware's claim, execution and
// replay are logged.
func TestObservers(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var out bytes.Buffer
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(&lockedWriter{w: &out, mu: &mu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	clientObs, serverObs := Observers(log)
	mw := idempotency.New(memstore.New(), serverObs)
	var served atomic.Int32
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Add(1) == 1 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	client := saferetry.NewClient(clientObs, saferetry.WithLogger(nil))
	defer client.CloseIdleConnections()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("{}"))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer acct_1")
	resp, err := client.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	mu.Lock()
	logged := out.String()
	mu.Unlock()
	assert.Equal(t, 2, strings.Count(logged, "msg=attempt "), logged)
	assert.Contains(t, logged, "class=status_503")
	assert.Contains(t, logged, "outcome=retry")
	assert.Contains(t, logged, "msg=idempotency")
	assert.Contains(t, logged, "op=claim")
}

// lockedWriter serialises the writes of concurrent log records.
type lockedWriter struct {
	w  io.Writer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
