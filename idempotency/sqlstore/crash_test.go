//go:build unix

package sqlstore_test

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// requirePG skips a PostgreSQL test when SAFERETRY_PG_DSN is unset, unless
// SAFERETRY_REQUIRE_PG=1, which makes the missing DSN a failure.
func requirePG(t *testing.T) {
	t.Helper()
	if os.Getenv("SAFERETRY_PG_DSN") == "" && os.Getenv("SAFERETRY_REQUIRE_PG") == "1" {
		t.Fatal("SAFERETRY_REQUIRE_PG=1 but SAFERETRY_PG_DSN is not set")
	}
	pgDSN(t) // skips when unset
}

// crashDB is one database that several phaseserver processes share in turn.
type crashDB struct {
	driver, dsn string
	db          *sql.DB // the test's own connection, for assertions
}

func forEachCrashDB(t *testing.T, f func(t *testing.T, d crashDB)) {
	t.Run("sqlite", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "shop.db")
		db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		f(t, crashDB{driver: "sqlite", dsn: path, db: db})
	})
	t.Run("postgres", func(t *testing.T) {
		requirePG(t)
		db := openPG(t)
		var schema string
		require.NoError(t, db.QueryRow(`SELECT current_schema()`).Scan(&schema))
		f(t, crashDB{driver: "pgx", dsn: withParam(pgDSN(t), "search_path", schema), db: db})
	})
	t.Run("mysql", func(t *testing.T) {
		cfg := mysqlDatabaseConfig(t)
		f(t, crashDB{driver: "mysql", dsn: cfg.FormatDSN(), db: openMySQLConfig(t, cfg, nil)})
	})
}

// cardProcessor is the fake external service: it de-duplicates charges by
// Idempotency-Key and counts calls and lookups per key.
type cardProcessor struct {
	*httptest.Server
	mu      sync.Mutex
	charges map[string]string
	calls   map[string]int
	lookups map[string]int
}

func newCardProcessor(t *testing.T) *cardProcessor {
	p := &cardProcessor{charges: map[string]string{}, calls: map[string]int{}, lookups: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" {
			http.Error(w, "key required", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		p.calls[key]++
		c, ok := p.charges[key]
		if !ok {
			c = fmt.Sprintf("ch_%d", len(p.charges)+1)
			p.charges[key] = c
		}
		p.mu.Unlock()
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, c)
	})
	mux.HandleFunc("GET /charges/{key}", func(w http.ResponseWriter, r *http.Request) {
		key := r.PathValue("key")
		p.mu.Lock()
		p.lookups[key]++
		c, ok := p.charges[key]
		p.mu.Unlock()
		if !ok {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, c)
	})
	p.Server = httptest.NewServer(mux)
	t.Cleanup(p.Close)
	return p
}

func (p *cardProcessor) counts() (calls, lookups map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	calls, lookups = map[string]int{}, map[string]int{}
	for k, v := range p.calls {
		calls[k] = v
	}
	for k, v := range p.lookups {
		lookups[k] = v
	}
	return calls, lookups
}

// buildPhaseServer builds internal/phaseserver into the test's temp dir.
func buildPhaseServer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "phaseserver")
	out, err := exec.CommandContext(t.Context(), "go", "build", "-o", bin, "./internal/phaseserver").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

type proc struct {
	url  string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process exited
}

// startPhaseServer starts one process and waits for its "listening on" line.
func startPhaseServer(t *testing.T, bin string, d crashDB, processor string, args ...string) *proc {
	t.Helper()
	args = append([]string{"-driver", d.driver, "-dsn", d.dsn, "-processor", processor, "-lease", "500ms"}, args...)
	cmd := exec.Command(bin, args...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	select {
	case line, ok := <-lines:
		require.True(t, ok, "phaseserver exited before listening")
		addr, found := strings.CutPrefix(line, "listening on ")
		require.True(t, found, "unexpected first line %q", line)
		p.url = "http://" + addr
	case <-time.After(60 * time.Second):
		t.Fatal("phaseserver did not start")
	}
	return p
}

// requireKilled waits for the process to die and checks it was SIGKILL.
func (p *proc) requireKilled(t *testing.T) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the process did not die")
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "exit: %v", p.cmd.ProcessState)
}

type payAnswer struct {
	status   int
	body     string
	replayed bool
}

const payBody = `{"amount":4200}`

func pay(url, key string) (payAnswer, error) {
	req, err := http.NewRequest(http.MethodPost, url+"/payments", strings.NewReader(payBody))
	if err != nil {
		return payAnswer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Account", "acct-1")
	// A fresh connection per request: net/http would otherwise re-send a
	// keyed request on its own when a reused connection breaks.
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return payAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return payAnswer{resp.StatusCode, string(b), resp.Header.Get(idempotency.ReplayedHeader) == "true"}, err
}

// payUntilSettled retries while the previous owner's lease is alive (409
// in progress), as a client does.
func payUntilSettled(t *testing.T, url, key string) payAnswer {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		a, err := pay(url, key)
		require.NoError(t, err)
		if a.status != http.StatusConflict || time.Now().After(deadline) {
			return a
		}
		require.Contains(t, a.body, idempotency.CodeInProgress)
		time.Sleep(50 * time.Millisecond)
	}
}

type recordRow struct {
	state      int
	point      string
	data       []byte
	generation int64
}

func readRecord(t *testing.T, db *sql.DB, key string) recordRow {
	t.Helper()
	var r recordRow
	require.NoError(t, db.QueryRow(`SELECT state, recovery_point, recovery_data, generation FROM `+sqlstore.DefaultTable+
		` WHERE idem_key = $1`, []byte(key)).Scan(&r.state, &r.point, &r.data, &r.generation))
	return r
}

func count(t *testing.T, db *sql.DB, query string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(query).Scan(&n))
	return n
}

// requireOnePayment checks the business tables after the request completed:
// one order, made by pid orderPID, and one receipt for it.
func requireOnePayment(t *testing.T, db *sql.DB, key string, orderPID int) {
	t.Helper()
	require.Equal(t, 1, count(t, db, `SELECT COUNT(*) FROM orders WHERE idem_key = '`+key+`'`), "one order")
	require.Equal(t, 1, count(t, db, `SELECT COUNT(*) FROM orders WHERE pid = `+fmt.Sprint(orderPID)), "made by the killed process")
	require.Equal(t, 1, count(t, db, `SELECT COUNT(*) FROM receipts r JOIN orders o ON o.id = r.order_id WHERE o.idem_key = '`+key+`'`), "one receipt")
}

// The crash-recovery gate, on SQLite,
// PostgreSQL and MySQL, with real processes killed by SIGKILL:
//
//  1. killed between the order phase and the charge: a client retry on a
//     fresh process resumes at the charge; the processor saw one call;
//  2. killed after the processor answered, before the charge phase
//     committed: the retry finds the intent, looks the charge up by its
//     downstream key instead of calling again, and completes.
//
// Either way the order is not created again, the response is stored, and a
// later retry gets it replayed.
func TestCrashRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	bin := buildPhaseServer(t)
	forEachCrashDB(t, func(t *testing.T, d crashDB) {
		for _, tc := range []struct {
			crash, point string
			lookups      int
		}{
			{crash: "after-order", point: "order", lookups: 0},
			{crash: "after-charge", point: "intent:charge", lookups: 1},
		} {
			t.Run(tc.crash, func(t *testing.T) {
				cards := newCardProcessor(t)
				key := "order-42-" + tc.crash

				a := startPhaseServer(t, bin, d, cards.URL, "-crash", tc.crash)
				_, err := pay(a.url, key)
				require.Error(t, err, "the process died without answering")
				a.requireKilled(t)

				rec := readRecord(t, d.db, key)
				require.Equal(t, int(idempotency.InProgress), rec.state)
				require.Equal(t, tc.point, rec.point)
				var recovery struct { // the recovery data Phase and External write
					Phases  []struct{ Name string }
					Pending *struct {
						DownstreamKey string `json:"downstream_key"`
					}
				}
				require.NoError(t, json.Unmarshal(rec.data, &recovery))
				require.Equal(t, "order", recovery.Phases[0].Name)
				require.Equal(t, 1, count(t, d.db, `SELECT COUNT(*) FROM orders WHERE idem_key = '`+key+`'`), "the order phase committed")
				calls, _ := cards.counts()
				if tc.crash == "after-order" {
					require.Empty(t, calls, "killed before the charge")
				} else {
					require.Len(t, calls, 1, "the processor charged before the kill")
					require.NotNil(t, recovery.Pending, "the intent was recorded before the call")
					require.Equal(t, 1, calls[recovery.Pending.DownstreamKey])
				}

				b := startPhaseServer(t, bin, d, cards.URL)
				first := payUntilSettled(t, b.url, key)
				require.Equal(t, http.StatusCreated, first.status, first.body)
				require.False(t, first.replayed)
				require.Contains(t, first.body, fmt.Sprintf(`"receipt_pid":%d`, b.cmd.Process.Pid), "completed by the fresh process")

				calls, lookups := cards.counts()
				require.Len(t, calls, 1, "one downstream key")
				for k, n := range calls {
					require.Equal(t, 1, n, "the processor saw the charge %s once", k)
					require.Equal(t, tc.lookups, lookups[k], "lookups of %s", k)
				}
				requireOnePayment(t, d.db, key, a.cmd.Process.Pid)
				rec = readRecord(t, d.db, key)
				require.Equal(t, int(idempotency.Completed), rec.state)
				require.EqualValues(t, 2, rec.generation, "one takeover")

				again, err := pay(b.url, key)
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, again.status)
				require.True(t, again.replayed)
				require.Equal(t, first.body, again.body)
				calls, _ = cards.counts()
				require.Len(t, calls, 1)
			})
		}
	})
}

// A request abandoned by a kill, with no client retry, is
// completed by the completer of a fresh process once the lease expired;
// a later client retry gets the replay.
func TestCrashCompleter(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	bin := buildPhaseServer(t)
	forEachCrashDB(t, func(t *testing.T, d crashDB) {
		for _, crash := range []string{"after-order", "after-charge"} {
			t.Run(crash, func(t *testing.T) {
				cards := newCardProcessor(t)
				key := "order-7-" + crash
				a := startPhaseServer(t, bin, d, cards.URL, "-crash", crash)
				_, err := pay(a.url, key)
				require.Error(t, err)
				a.requireKilled(t)

				b := startPhaseServer(t, bin, d, cards.URL, "-completer", "50ms")
				deadline := time.Now().Add(30 * time.Second)
				for readRecord(t, d.db, key).state != int(idempotency.Completed) {
					require.True(t, time.Now().Before(deadline), "the completer did not complete the request")
					time.Sleep(20 * time.Millisecond)
				}
				calls, lookups := cards.counts()
				require.Len(t, calls, 1)
				for k, n := range calls {
					require.Equal(t, 1, n, "charged once")
					if crash == "after-charge" {
						require.Equal(t, 1, lookups[k], "the completer looked the charge up")
					}
				}
				requireOnePayment(t, d.db, key, a.cmd.Process.Pid)

				replay, err := pay(b.url, key)
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, replay.status, replay.body)
				require.True(t, replay.replayed, "the client's retry gets the stored response")
				require.Contains(t, replay.body, fmt.Sprintf(`"receipt_pid":%d`, b.cmd.Process.Pid))
			})
		}
	})
}

// An owner that stalled past its lease and was taken
// over cannot commit its next phase, and that phase's writes roll back. The
// successor is a claim with its own clock (an hour later): the store takes
// every time from its caller, so no test sleeps. (The owner stalls between
// phases: on SQLite a phase's transaction holds the write lock, so a claim
// cannot overtake a phase that is running.)
func TestPhaseFencingSQL(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		if b.dialect == sqlstore.Postgres {
			requirePG(t)
		}
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		stalled, resume := make(chan idempotency.Record), make(chan struct{})
		phaseErr := make(chan error, 1)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			run, _ := idempotency.FromContext(ctx)
			_, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
				return []byte("ord_1"), insertOrder(ctx, "ord_1", "cus_1")
			})
			if err != nil {
				phaseErr <- err
				return
			}
			rec, err := s.Get(ctx, run.Scope)
			if err != nil {
				phaseErr <- err
				return
			}
			stalled <- rec
			<-resume
			_, err = run.Phase(ctx, "charge", func(ctx context.Context) ([]byte, error) {
				return []byte("late"), insertOrder(ctx, "ord_2", "cus_1")
			})
			phaseErr <- err
			w.WriteHeader(http.StatusServiceUnavailable)
		})
		srv := httptest.NewServer(idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(slog.New(slog.DiscardHandler))).Wrap(h))
		t.Cleanup(srv.Close)
		done := make(chan error, 1)
		go func() { _, err := pay(srv.URL, "k-fence"); done <- err }()

		rec := <-stalled
		require.Equal(t, "order", rec.RecoveryPoint)
		succ, ok, err := claimed(s.Claim(t.Context(), idempotency.Claim{
			Scope: rec.Scope, Fingerprint: rec.Fingerprint, FingerprintVersion: rec.FingerprintVersion,
			Owner: "successor", Now: time.Now().Add(time.Hour), LeaseFor: 2 * time.Hour,
		}))
		require.NoError(t, err)
		require.True(t, ok, "the successor takes the expired lease over")
		require.Equal(t, rec.Generation+1, succ.Generation)
		close(resume)

		err = <-phaseErr
		require.NoError(t, <-done)
		require.ErrorIs(t, err, idempotency.ErrLeaseLost)
		var pe *idempotency.PhaseError
		require.ErrorAs(t, err, &pe)
		require.Equal(t, "charge", pe.Phase)
		require.Equal(t, "commit", pe.Step, "the fence holds at the phase's commit")
		require.Equal(t, 1, countOrders(t, db), "the fenced phase's write rolled back")
		got, err := s.Get(t.Context(), rec.Scope)
		require.NoError(t, err)
		require.Equal(t, "successor", got.Owner)
		require.Equal(t, "order", got.RecoveryPoint)
		require.JSONEq(t, `{"v":1,"phases":[{"name":"order","output":"b3JkXzE="}]}`, string(got.RecoveryData),
			"the recovery data as Phase wrote it: the order phase, output ord_1")
	})
}

// Phases commit in their own transactions, sqlstore.Tx inside a phase is the
// phase's, a failed phase rolls its writes back, and the request's
// transaction is begun only when the handler asks for it: while a phase's
// external call is in flight no transaction is open, so on SQLite another
// request can claim, write and complete meanwhile.
func TestPhaseTransactionsSQL(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		if b.dialect == sqlstore.Postgres {
			requirePG(t)
		}
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		inCall, release := make(chan struct{}), make(chan struct{})
		boom := errors.New("out of stock")
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			run, _ := idempotency.FromContext(ctx)
			key := run.Scope.Key
			if key == "other" {
				if err := insertOrder(ctx, "ord_other", "cus_1"); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
				return
			}
			var phaseTx *sql.Tx
			_, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
				phaseTx, _ = sqlstore.Tx(ctx)
				return nil, insertOrder(ctx, "ord_1", "cus_1")
			})
			require.NoError(t, err)
			_, err = run.Phase(ctx, "reserve", func(ctx context.Context) ([]byte, error) {
				if err := insertOrder(ctx, "ord_reserved", "cus_1"); err != nil {
					return nil, err
				}
				return nil, boom
			})
			require.ErrorIs(t, err, boom)
			_, err = run.External(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
				close(inCall)
				<-release
				return []byte("ch_1"), nil
			}, nil)
			require.NoError(t, err)
			tx, ok := sqlstore.Tx(ctx)
			require.True(t, ok)
			require.NotSame(t, phaseTx, tx, "the request's transaction is not the phase's")
			_, err = run.Phase(ctx, "late", func(context.Context) ([]byte, error) { return nil, nil })
			require.ErrorIs(t, err, idempotency.ErrMisuse, "no phase once the request's transaction is open")
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, amount, customer) VALUES ('ord_final', 1, 'cus_1')`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		srv := httptest.NewServer(idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(slog.New(slog.DiscardHandler))).Wrap(h))
		t.Cleanup(srv.Close)
		done := make(chan payAnswer, 1)
		go func() { a, _ := pay(srv.URL, "slow"); done <- a }()
		<-inCall
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		require.Equal(t, 1, countOrders(t, db), "the order committed with its phase, the failed phase's write did not")
		otherDone := make(chan payAnswer, 1)
		go func() { a, _ := pay(srv.URL, "other"); otherDone <- a }()
		select {
		case a := <-otherDone:
			require.Equal(t, http.StatusCreated, a.status, a.body)
		case <-ctx.Done():
			t.Fatal("another request could not write while a phase's external call was in flight")
		}
		close(release)
		a := <-done
		require.Equal(t, http.StatusCreated, a.status, a.body)
		require.Equal(t, 3, countOrders(t, db), "ord_1, ord_other and ord_final")
		rec := readRecord(t, db, "slow")
		require.Equal(t, int(idempotency.Completed), rec.state)
		require.Equal(t, "charge", rec.point)
	})
}
