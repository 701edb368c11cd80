//go:build unix

package sqlstore_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// A server killed after the order phase leaves the request in progress; a
// fresh process's Completer resumes it, and its handler, which checks
// credentials itself, refuses the resume (a resumed request carries none)
// with 401. That refusal is never stored: the record stays in progress,
// its lease ended, and the client's retry, with its credentials, takes it
// over and completes it. One order, one receipt, one charge, and a 201
// that is no replay, on SQLite and PostgreSQL, with real processes killed
// by SIGKILL.
func TestCrashResumeWithoutCredentials(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and kills server processes")
	}
	bin := buildPhaseServer(t)
	forEachCrashDB(t, func(t *testing.T, d crashDB) {
		cards := newCardProcessor(t)
		key := "order-auth"
		a := startPhaseServer(t, bin, d, cards.URL, "-crash", "after-order", "-auth")
		_, err := pay(a.url, key)
		require.Error(t, err, "the process died without answering")
		a.requireKilled(t)

		b := startPhaseServer(t, bin, d, cards.URL, "-completer", "50ms", "-auth")
		deadline := time.Now().Add(30 * time.Second)
		for {
			var state int
			var gen, leaseUntil int64
			require.NoError(t, d.db.QueryRow(`SELECT state, generation, lease_until FROM `+sqlstore.DefaultTable+
				` WHERE idem_key = $1`, []byte(key)).Scan(&state, &gen, &leaseUntil))
			if gen >= 2 && (state == int(idempotency.Completed) || leaseUntil <= time.Now().UnixNano()) {
				require.Equal(t, int(idempotency.InProgress), state, "the resume's 401 was stored")
				break
			}
			require.True(t, time.Now().Before(deadline), "the completer did not resume the request")
			time.Sleep(20 * time.Millisecond)
		}
		require.Equal(t, "order", readRecord(t, d.db, key).point)

		first := payUntilSettled(t, b.url, key)
		require.Equal(t, http.StatusCreated, first.status, first.body)
		require.False(t, first.replayed)
		require.Contains(t, first.body, fmt.Sprintf(`"receipt_pid":%d`, b.cmd.Process.Pid))
		requireOnePayment(t, d.db, key, a.cmd.Process.Pid)
		calls, _ := cards.counts()
		require.Len(t, calls, 1)
		for k, n := range calls {
			require.Equal(t, 1, n, "the processor saw the charge %s once", k)
		}
		rec := readRecord(t, d.db, key)
		require.Equal(t, int(idempotency.Completed), rec.state)
		require.EqualValues(t, 3, rec.generation, "the Completer's takeover, then the client's")
	})
}
