package idemcheck_test

import (
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

// echoAPI runs the effect on every request and answers with what the
// request sent: its key and its account. It refuses a key reused with
// another body (422) and a malformed key (400), so that it looks
// idempotent from outside.
func echoAPI(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var effects atomic.Int64
	var mu sync.Mutex
	bodies := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		account, ok := accounts[r.Header.Get("Authorization")]
		if !ok {
			http.Error(w, "who are you?", http.StatusUnauthorized)
			return
		}
		key, err := keygen.ParseHeader(r.Header.Values("Idempotency-Key"))
		if err != nil {
			http.Error(w, "bad key", http.StatusBadRequest)
			return
		}
		b, _ := io.ReadAll(r.Body)
		fp := fmt.Sprintf("%x", sha256.Sum256(b))
		mu.Lock()
		prev, seen := bodies[account+key]
		if !seen {
			bodies[account+key] = fp
		}
		mu.Unlock()
		if seen && prev != fp {
			http.Error(w, "key reused", http.StatusUnprocessableEntity)
			return
		}
		effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"key":%q,"account":%q,"status":"accepted"}`, key, account)
	}))
	t.Cleanup(srv.Close)
	return srv, &effects
}

// An answer that only echoes what the request sent (its key, its account)
// is no evidence of one effect: a target that runs the effect on every
// request passes nothing that rests on telling effects apart; those checks
// are skipped, with the reason, whether effects are told apart by the
// whole body or by a member (IDField) that holds the key.
func TestAnswersThatEchoTheRequestAreNoEvidence(t *testing.T) {
	for _, idField := range []string{"", "key"} {
		t.Run("IDField "+idField, func(t *testing.T) {
			srv, effects := echoAPI(t)
			cfg := config(srv.URL, 4)
			cfg.IDField = idField
			rep, err := idemcheck.Run(t.Context(), cfg)
			require.NoError(t, err)
			t.Log("\n" + rep.String())
			for _, c := range rep.Checks {
				switch c.Name {
				case "replay", "concurrent", "mismatch", "scope":
					require.Equal(t, idemcheck.Skip, c.Result, "%s: %s", c.Name, c.Detail)
					require.Contains(t, c.Detail, "differ only by the key they echo", c.Name)
				case "marker":
					require.Contains(t, c.Detail, "unverified: the answers do not identify their effect")
				}
			}
			require.Greater(t, effects.Load(), int64(12), "every request ran")
		})
	}
}

// powertoolsAPI is an idempotent API that answers 422 to every retry of a
// completed request, whatever its body (AWS Powertools' TypeScript
// idempotency 2.35.0 over Redis, with payload validation on, does).
func powertoolsAPI(t *testing.T) *httptest.Server {
	t.Helper()
	var effects atomic.Int64
	var mu sync.Mutex
	done := map[string]bool{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		account, ok := accounts[r.Header.Get("Authorization")]
		key, err := keygen.ParseHeader(r.Header.Values("Idempotency-Key"))
		switch {
		case !ok:
			http.Error(w, "who are you?", http.StatusUnauthorized)
			return
		case err != nil:
			http.Error(w, "bad key", http.StatusBadRequest)
			return
		}
		mu.Lock()
		reused := done[account+key]
		done[account+key] = true
		mu.Unlock()
		if reused {
			http.Error(w, `{"message":"payload does not match"}`, http.StatusUnprocessableEntity)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// mismatch passes only when the unchanged body, under the same key, is
// replayed: a target that refuses every reuse of a key, whatever the body,
// gets skip for mismatch, with the reason, never a pass (and replay fails:
// a client's retry gets the refusal).
func TestMismatchSkipsATargetThatRefusesEveryReuse(t *testing.T) {
	srv := powertoolsAPI(t)
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, 4))
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	byName := map[string]idemcheck.Check{}
	for _, c := range rep.Checks {
		byName[c.Name] = c
	}
	require.Equal(t, idemcheck.Skip, byName["mismatch"].Result)
	require.Contains(t, byName["mismatch"].Detail, "the target refuses every reuse of the key, whatever the body")
	require.Contains(t, byName["mismatch"].Evidence[1], "first key, unchanged body: 422")
	require.Equal(t, idemcheck.Fail, byName["replay"].Result)
}

// flaky answers the second request of each key with a transient 502, 503
// or 504 in turn (a gateway's hiccup), before it reaches h.
func flaky(h http.Handler) (http.Handler, *atomic.Int64) {
	var mu sync.Mutex
	seen := map[string]int{}
	var n atomic.Int64
	statuses := []int{http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		seen[key]++
		second := seen[key] == 2
		mu.Unlock()
		if second {
			http.Error(w, "gateway hiccup", statuses[int(n.Add(1))%len(statuses)])
			return
		}
		h.ServeHTTP(w, r)
	}), &n
}

// A transient 502, 503 or 504 during a check is sent again once, as a
// retrying client would, and reported in the check's evidence and detail;
// it is not a failure of the check.
func TestTransientAnswersAreSentAgainOnce(t *testing.T) {
	var effects atomic.Int64
	h := idempotency.New(memstore.New(), idempotency.WithPrincipal(principal),
		idempotency.WithLogger(slog.New(slog.DiscardHandler))).
		Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
		}))
	g, hiccups := flaky(h)
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	cfg := config(srv.URL, 4)
	cfg.URL = srv.URL // the handler is the whole server
	rep, err := idemcheck.Run(t.Context(), cfg)
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.False(t, rep.Failed())
	require.Positive(t, hiccups.Load())
	replay := rep.Checks[0]
	require.Equal(t, idemcheck.Pass, replay.Result)
	require.Contains(t, replay.Detail, "1 transient answers (502, 503, 504, or none) were sent again once")
	require.Contains(t, strings.Join(replay.Evidence, "\n"), "(a transient 503 first, sent again)")
}

// OnCheck sees each check's result as the check finishes, in order, and
// the result is final: the report holds the same.
func TestOnCheckSeesEachVerdictAsItFinishes(t *testing.T) {
	const n = 4
	srv, _, _ := serveMiddleware(t, newStore(), n)
	cfg := config(srv.URL, n)
	var seen []idemcheck.Check
	cfg.OnCheck = func(c idemcheck.Check) { seen = append(seen, c) }
	rep, err := idemcheck.Run(t.Context(), cfg)
	require.NoError(t, err)
	require.Equal(t, rep.Checks, seen)
}
