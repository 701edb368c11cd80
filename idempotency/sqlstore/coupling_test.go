package sqlstore_test

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// orderServer serves POST /orders guarded by the middleware over s. The
// handler inserts the order named by the body ("<id> <customer>") through
// the unit's transaction, then answers the status in the ?status= query
// parameter (default 201). runs counts handler executions.
func orderServer(t *testing.T, s *sqlstore.Store) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, ok := sqlstore.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		body, _ := io.ReadAll(r.Body)
		id, customer, _ := strings.Cut(string(body), " ")
		if _, err := tx.ExecContext(r.Context(),
			`INSERT INTO orders (id, amount, customer) VALUES ($1, 100, $2)`, id, customer); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		status := http.StatusCreated
		if v := r.URL.Query().Get("status"); v != "" {
			_, _ = fmt.Sscan(v, &status)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = fmt.Fprintf(w, `{"order":%q,"run":%d}`, id, runs.Load())
	})
	mw := idempotency.New(s, idempotency.WithPrincipal(func(*http.Request) (string, error) { return "acct_1", nil }))
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &runs
}

type answer struct {
	status   int
	body     string
	replayed bool
}

func post(t *testing.T, srv *httptest.Server, query, key, body string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders"+query, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "text/plain")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}

func countRecords(t *testing.T, db *sql.DB, key string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM `+sqlstore.DefaultTable+` WHERE idem_key = $1`, []byte(key)).Scan(&n))
	return n
}

func hasOrder(t *testing.T, db *sql.DB, id string) bool {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM orders WHERE id = '`+id+`'`).Scan(&n))
	return n == 1
}

// TestCouplingFailedHandlerLeavesNoRowAndReleasesTheKey: a handler that inserted its business row and then answered
// 500 leaves no row, and the key is released (a retry runs again).
func TestCouplingFailedHandlerLeavesNoRowAndReleasesTheKey(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		srv, runs := orderServer(t, s)

		a := post(t, srv, "?status=500", "k-500", "ord_500 cus_1")
		require.Equal(t, http.StatusInternalServerError, a.status)
		require.False(t, hasOrder(t, db, "ord_500"), "the 500 rolled the business row back")
		require.Zero(t, countRecords(t, db, "k-500"), "the key is released")

		// The retry runs the handler again and this time succeeds.
		a = post(t, srv, "", "k-500", "ord_500 cus_1")
		require.Equal(t, http.StatusCreated, a.status)
		require.False(t, a.replayed)
		require.EqualValues(t, 2, runs.Load())
		require.True(t, hasOrder(t, db, "ord_500"))
	})
}

// TestCouplingSuccessStoresRowAndResponse: a 201 leaves the row and the stored response; a retry replays it without
// running the handler.
func TestCouplingSuccessStoresRowAndResponse(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		srv, runs := orderServer(t, s)

		first := post(t, srv, "", "k-201", "ord_201 cus_1")
		require.Equal(t, http.StatusCreated, first.status)
		require.True(t, hasOrder(t, db, "ord_201"))
		var state, status int
		require.NoError(t, db.QueryRow(`SELECT state, response_status FROM `+sqlstore.DefaultTable+` WHERE idem_key = $1`, []byte("k-201")).Scan(&state, &status))
		require.Equal(t, int(idempotency.Completed), state)
		require.Equal(t, http.StatusCreated, status)

		again := post(t, srv, "", "k-201", "ord_201 cus_1")
		require.Equal(t, http.StatusCreated, again.status)
		require.True(t, again.replayed)
		require.Equal(t, first.body, again.body)
		require.EqualValues(t, 1, runs.Load(), "the replay did not run the handler")
	})
}

// TestCouplingFailureAtCommitLeavesNeither: a real failure at the completion's COMMIT (a deferred foreign key on
// SQLite, a deferred constraint trigger on PostgreSQL) leaves neither the
// business row nor the stored response, and the key is free again.
func TestCouplingFailureAtCommitLeavesNeither(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		srv, runs := orderServer(t, s)

		a := post(t, srv, "", "k-commit", "ord_bad cus_missing")
		require.Equal(t, http.StatusServiceUnavailable, a.status)
		require.Contains(t, a.body, idempotency.CodeStoreUnavailable)
		require.NotContains(t, a.body, "ord_bad", "nothing of the handler's response was sent")
		require.False(t, hasOrder(t, db, "ord_bad"))
		require.Zero(t, countRecords(t, db, "k-commit"), "no stored response, key released")

		// Once the customer exists, the retry runs and commits.
		_, err := db.Exec(`INSERT INTO customers (id) VALUES ('cus_missing')`)
		require.NoError(t, err)
		a = post(t, srv, "", "k-commit", "ord_bad cus_missing")
		require.Equal(t, http.StatusCreated, a.status)
		require.EqualValues(t, 2, runs.Load())
		require.True(t, hasOrder(t, db, "ord_bad"))
		require.Equal(t, 1, countRecords(t, db, "k-commit"))
	})
}

// TestMiddlewareOneKeyManyGoroutines sends 64 concurrent requests with one
// key through the middleware over each dialect: the handler runs once, one
// order exists, and every other answer is the in-progress conflict or a
// replay of the same response. (On SQLite the claims queue behind the
// winner's write lock, so they mostly get the replay.)
func TestMiddlewareOneKeyManyGoroutines(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, db := newStore(t, b)
		createOrders(t, db, b.dialect)
		srv, runs := orderServer(t, s)
		const n = 64
		answers := make([]answer, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				answers[i] = postNoFail(srv, "k-many", "ord_many cus_1")
			}()
		}
		close(start)
		wg.Wait()
		require.EqualValues(t, 1, runs.Load(), "the handler ran once")
		require.True(t, hasOrder(t, db, "ord_many"))
		var original string
		for _, a := range answers {
			if a.status == http.StatusCreated && !a.replayed {
				require.Empty(t, original, "two originals")
				original = a.body
			}
		}
		require.NotEmpty(t, original)
		for i, a := range answers {
			switch {
			case a.status == http.StatusCreated:
				require.Equal(t, original, a.body, "answer %d", i)
			case a.status == http.StatusConflict:
				require.Contains(t, a.body, idempotency.CodeInProgress)
			default:
				t.Fatalf("answer %d: %d %s", i, a.status, a.body)
			}
		}
	})
}

// postNoFail is post for goroutines other than the test's: errors become a
// status 0 answer that the caller's checks reject.
func postNoFail(srv *httptest.Server, key, body string) answer {
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
	if err != nil {
		return answer{body: err.Error()}
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "text/plain")
	resp, err := srv.Client().Do(req)
	if err != nil {
		return answer{body: err.Error()}
	}
	defer resp.Body.Close()
	bb, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{body: err.Error()}
	}
	return answer{status: resp.StatusCode, body: string(bb), replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}
