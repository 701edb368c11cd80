package sqlstore_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// TestIdemcheckPassesOnSQLStores runs the idemcheck conformance checker
// against the middleware on each SQL store, the handler writing its effect
// in the request's transaction: every check passes (in_progress and marker
// report as info), and the run leaves exactly the effects it meant to make.
func TestIdemcheckPassesOnSQLStores(t *testing.T) {
	const n = 8
	forEach(t, func(t *testing.T, b backend) {
		store, db := newStore(t, b)
		_, err := db.Exec(`CREATE TABLE effects (id VARCHAR(255) PRIMARY KEY)`)
		require.NoError(t, err)

		accounts := map[string]string{"Bearer tok_1": "acct_1", "Bearer tok_2": "acct_2"}
		mw := idempotency.New(store,
			idempotency.WithPrincipal(func(r *http.Request) (string, error) {
				if a, ok := accounts[r.Header.Get("Authorization")]; ok {
					return a, nil
				}
				return "", fmt.Errorf("unknown credentials: %w", idempotency.ErrPrincipalRefused)
			}),
			idempotency.WithLogger(slog.New(slog.DiscardHandler)))
		var next atomic.Int64
		hold := newConflictHold(n)
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hold.wait(r.Header.Get("Idempotency-Key"))
			tx, ok := sqlstore.Tx(r.Context())
			if !ok {
				http.Error(w, "no transaction", http.StatusServiceUnavailable)
				return
			}
			id := fmt.Sprintf("eff_%d", next.Add(1))
			if _, err := tx.ExecContext(r.Context(), `INSERT INTO effects (id) VALUES ($1)`, id); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":%q}`, id)
		})))
		srv := httptest.NewServer(hold.count(mux))
		defer srv.Close()

		rep, err := idemcheck.Run(t.Context(), idemcheck.Config{
			URL:  srv.URL + "/payments",
			Body: []byte(`{"order":"42","amount":4200}`),
			Header: http.Header{
				"Authorization": {"Bearer tok_1"},
				"Content-Type":  {"application/json"},
			},
			Other:         http.Header{"Authorization": {"Bearer tok_2"}},
			IDField:       "id",
			N:             n,
			MaxRetryAfter: time.Millisecond, // the middleware's Retry-After: 1, shortened
		})
		require.NoError(t, err)
		t.Log("\n" + rep.String())
		got := map[string]idemcheck.Result{}
		for _, c := range rep.Checks {
			got[c.Name] = c.Result
		}
		require.Equal(t, map[string]idemcheck.Result{
			"replay": idemcheck.Pass, "concurrent": idemcheck.Pass, "in_progress": idemcheck.Info,
			"mismatch": idemcheck.Pass, "scope": idemcheck.Pass, "invalid_key": idemcheck.Pass,
			"marker": idemcheck.Info,
		}, got)

		// The first two requests, the concurrent key, the mismatch control,
		// the second principal and the two marker keys: seven rows, one each.
		var rows int
		require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM effects`).Scan(&rows))
		require.Equal(t, 7, rows)
	})
}

// conflictHold makes the conflicts of idemcheck's concurrent check certain:
// the execution of its key (named idemcheck-concurrent-...) waits, at most
// 10 s, until the middleware has answered the other n-1 duplicates, which
// it does with 409 while the key is in progress.
type conflictHold struct {
	n        int
	mu       sync.Mutex
	answered map[string]int
	released map[string]chan struct{}
}

func newConflictHold(n int) *conflictHold {
	return &conflictHold{n: n, answered: map[string]int{}, released: map[string]chan struct{}{}}
}

func (h *conflictHold) ch(key string) chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.released[key] == nil {
		h.released[key] = make(chan struct{})
	}
	return h.released[key]
}

// count counts, per key, the answers written through next.
func (h *conflictHold) count(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r)
		key := r.Header.Get("Idempotency-Key")
		ch := h.ch(key)
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.answered[key]++; h.answered[key] == h.n-1 {
			close(ch)
		}
	})
}

func (h *conflictHold) wait(key string) {
	if !strings.HasPrefix(key, "idemcheck-concurrent-") {
		return
	}
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-h.ch(key):
	case <-t.C:
	}
}
