package sqlstore_test

import (
	"bufio"
	"context"
	"database/sql"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestGateCrossProcessOneKey is the cross-process concurrency gate: 4 server processes (internal/gateserver, built here) share one
// PostgreSQL or MySQL database; 400 concurrent requests with one key are spread over
// them. Exactly one business row exists afterwards, the handler ran once
// (its non-transactional side effect is counted too: fencing and the
// transaction alone would keep the row count at one even if two executions
// overlapped), and every answer is the in-progress conflict or a replay
// identical to the one success.
func TestGateCrossProcessOneKey(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs 4 server processes")
	}
	bin := buildGateServer(t)
	t.Run("postgres", func(t *testing.T) {
		dsn := pgDSN(t)
		db := openPG(t)
		var schema string
		require.NoError(t, db.QueryRow(`SELECT current_schema()`).Scan(&schema))
		gate(t, bin, db, sqlstore.Postgres, "pgx", withParam(dsn, "search_path", schema),
			`CREATE TABLE charges (id BIGSERIAL PRIMARY KEY, idem_key TEXT NOT NULL, pid INTEGER NOT NULL)`)
	})
	t.Run("mysql", func(t *testing.T) {
		cfg := mysqlDatabaseConfig(t)
		gate(t, bin, openMySQLConfig(t, cfg, nil), sqlstore.MySQL, "mysql", cfg.FormatDSN(),
			`CREATE TABLE charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key TEXT NOT NULL, pid INTEGER NOT NULL)`)
	})
}

// gate runs the gate on db, which gateserver processes of driver open with
// dsn; chargesDDL creates the business table in the database's dialect d.
func gate(t *testing.T, bin string, db *sql.DB, d sqlstore.Dialect, driver, dsn, chargesDDL string) {
	const (
		processes = 4
		requests  = 400
	)
	s, err := sqlstore.Open(db, d)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	_, err = db.Exec(chargesDDL)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TABLE executions (idem_key TEXT NOT NULL, pid INTEGER NOT NULL)`)
	require.NoError(t, err)

	var urls []string
	for range processes {
		urls = append(urls, startGateServer(t, bin, driver, dsn))
	}

	type result struct {
		status   int
		body     string
		code     string
		replayed bool
		err      error
	}
	results := make([]result, requests)
	client := &http.Client{
		Timeout:   30 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: requests, MaxConnsPerHost: 0},
	}
	defer client.CloseIdleConnections()
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			req, err := http.NewRequest(http.MethodPost, urls[i%processes]+"/charges", strings.NewReader(`{"amount":4200,"currency":"eur"}`))
			if err != nil {
				results[i].err = err
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "gate-key-1")
			resp, err := client.Do(req)
			if err != nil {
				results[i].err = err
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			results[i] = result{status: resp.StatusCode, body: string(b), err: err,
				replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
			if resp.StatusCode == http.StatusConflict {
				results[i].code = problemCode(string(b))
			}
		}()
	}
	close(start)
	wg.Wait()

	var originals, replays, conflicts int
	success := ""
	for i, r := range results {
		require.NoError(t, r.err, "request %d", i)
		switch {
		case r.status == http.StatusCreated && !r.replayed:
			originals++
			success = r.body
		case r.status == http.StatusCreated && r.replayed:
			replays++
		case r.status == http.StatusConflict && r.code == string(idempotency.CodeInProgress):
			conflicts++
		default:
			t.Fatalf("request %d: unexpected answer %d %q", i, r.status, r.body)
		}
	}
	require.Equal(t, 1, originals, "exactly one request ran the handler")
	for i, r := range results {
		if r.replayed {
			require.Equal(t, success, r.body, "replay %d differs from the success", i)
		}
	}
	var rows int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM charges`).Scan(&rows))
	require.Equal(t, 1, rows, "exactly one business row")
	var execs int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM executions`).Scan(&execs))
	require.Equal(t, 1, execs, "the handler's non-transactional side effect ran once")
	t.Logf("%d requests over %d processes: 1 original, %d replays, %d in-progress conflicts", requests, processes, replays, conflicts)

	// A later retry on any process replays the same response.
	for _, u := range urls {
		req, err := http.NewRequest(http.MethodPost, u+"/charges", strings.NewReader(`{"amount":4200,"currency":"eur"}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "gate-key-1")
		resp, err := client.Do(req)
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		require.Equal(t, "true", resp.Header.Get(idempotency.ReplayedHeader))
		require.Equal(t, success, string(b))
	}
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM charges`).Scan(&rows))
	require.Equal(t, 1, rows)
}

// problemCode extracts the "code" member of a problem+json body.
func problemCode(body string) string {
	const k = `"code":"`
	i := strings.Index(body, k)
	if i < 0 {
		return ""
	}
	rest := body[i+len(k):]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}

func buildGateServer(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	require.NoError(t, err)
	bin := filepath.Join(t.TempDir(), "gateserver")
	cmd := exec.CommandContext(t.Context(), goBin, "build", "-o", bin, "./internal/gateserver")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// startGateServer starts one process, waits for its "listening on" line and
// registers its kill at cleanup. It returns the base URL.
func startGateServer(t *testing.T, bin, driver, dsn string) string {
	t.Helper()
	cmd := exec.Command(bin, "-driver", driver, "-dsn", dsn, "-work", "1500ms", "-conns", "10")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout) // drain until the process exits
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	select {
	case line, ok := <-lines:
		require.True(t, ok, "gateserver exited before listening")
		addr, found := strings.CutPrefix(line, "listening on ")
		require.True(t, found, "unexpected first line %q", line)
		return "http://" + addr
	case <-ctx.Done():
		t.Fatalf("gateserver did not start: %v", ctx.Err())
	}
	return ""
}
