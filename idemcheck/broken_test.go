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
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

// fault is what a deliberately broken server gets wrong.
type fault int

const (
	correct         fault = iota // no fault: every check passes
	noDedup                      // every request runs, keys are ignored
	checkThenInsert              // lookup and insert are two steps, without an atomic claim
	noFingerprint                // a reused key replays whatever body comes with it
	globalScope                  // the principal is not part of a key's scope
	regenerate                   // the replay rebuilds its body with a fresh "served" member
	lateKeyCheck                 // the effect runs first, then a bad key gets 500
	markerOnFirst                // first executions carry Idempotent-Replayed: true
	stuck                        // the concurrent check's key stays in progress for everyone else
	leakRegenerated              // globalScope and regenerate: a leaked replay differs from the first answer
	lenientKeys                  // any key is accepted, and de-duplicated as sent
	truncatedKeys                // any key is accepted, cut to 255 bytes
	badKeysIgnored               // a malformed key is accepted and ignored: every request with it runs
)

// fakeAPI is a small idempotent API written the way many are, with one
// fault switched on. Each execution creates an effect eff_<n>; its answer
// is {"id":"eff_<n>","served":<m>}, m counting the answers written.
type fakeAPI struct {
	fault fault
	n     int // the checker's concurrent duplicates (checkThenInsert's barrier)

	mu      sync.Mutex
	records map[string]*record
	effects int
	served  int
	arrived map[string]int           // requests of a key at the barrier
	barrier map[string]chan struct{} // closed when n requests arrived
}

type record struct {
	fingerprint string
	done        bool
	id          string
	body        string
}

func serveFake(t *testing.T, f fault, n int) (*httptest.Server, *fakeAPI) {
	t.Helper()
	api := &fakeAPI{fault: f, n: n, records: map[string]*record{},
		arrived: map[string]int{}, barrier: map[string]chan struct{}{}}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return srv, api
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	account, ok := accounts[r.Header.Get("Authorization")]
	if !ok {
		http.Error(w, "who are you?", http.StatusUnauthorized)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	key, keyErr := keygen.ParseHeader(r.Header.Values("Idempotency-Key"))
	switch f.fault {
	case lenientKeys:
		key, keyErr = r.Header.Get("Idempotency-Key"), nil
	case truncatedKeys:
		key, keyErr = r.Header.Get("Idempotency-Key"), nil
		key = key[:min(len(key), 255)]
	}
	if keyErr != nil && f.fault != lateKeyCheck && f.fault != badKeysIgnored {
		http.Error(w, "bad key", http.StatusBadRequest)
		return
	}
	if f.fault == noDedup || ((f.fault == lateKeyCheck || f.fault == badKeysIgnored) && keyErr != nil) {
		f.mu.Lock()
		id := f.newEffect()
		f.mu.Unlock()
		if keyErr != nil && f.fault == lateKeyCheck {
			http.Error(w, "internal error", http.StatusInternalServerError) // after the effect ran
			return
		}
		f.write(w, id, false)
		return
	}
	scope := account + "\x00" + key
	if f.fault == globalScope || f.fault == leakRegenerated {
		scope = key
	}
	fp := fmt.Sprintf("%x", sha256.Sum256(body))
	if f.fault == noFingerprint {
		fp = ""
	}

	f.mu.Lock()
	rec := f.records[scope]
	switch {
	case rec != nil && rec.fingerprint != fp:
		f.mu.Unlock()
		http.Error(w, "key reused", http.StatusUnprocessableEntity)
		return
	case rec != nil && !rec.done:
		f.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		http.Error(w, "in progress", http.StatusConflict)
		return
	case rec != nil:
		id, body := rec.id, rec.body
		f.mu.Unlock()
		if f.fault == regenerate || f.fault == leakRegenerated {
			f.write(w, id, true)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, body)
		return
	}
	if f.fault == checkThenInsert {
		// The lookup found nothing; the insert comes later, after the
		// barrier, so every concurrent duplicate passes the lookup.
		f.mu.Unlock()
		f.await(key)
		f.mu.Lock()
	}
	rec = &record{fingerprint: fp}
	f.records[scope] = rec
	rec.id = f.newEffect()
	f.mu.Unlock()

	rec.body = f.write(w, rec.id, f.fault == markerOnFirst)
	f.mu.Lock()
	rec.done = f.fault != stuck || !strings.HasPrefix(key, "idemcheck-concurrent-")
	f.mu.Unlock()
}

// newEffect runs the side effect; f.mu is held.
func (f *fakeAPI) newEffect() string {
	f.effects++
	return fmt.Sprintf("eff_%d", f.effects)
}

// write answers 201 with the effect and returns the body.
func (f *fakeAPI) write(w http.ResponseWriter, id string, replayed bool) string {
	f.mu.Lock()
	f.served++
	body := fmt.Sprintf(`{"id":%q,"served":%d}`, id, f.served)
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, body)
	return body
}

// await holds a request of the concurrent check's key until all n
// duplicates have arrived (at most 10 s): the race made certain.
func (f *fakeAPI) await(key string) {
	if !strings.HasPrefix(key, "idemcheck-concurrent-") {
		return
	}
	f.mu.Lock()
	ch := f.barrier[key]
	if ch == nil {
		ch = make(chan struct{})
		f.barrier[key] = ch
	}
	if f.arrived[key]++; f.arrived[key] == f.n {
		close(ch)
	}
	f.mu.Unlock()
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
	}
}

// TestBrokenServers runs the checker against each broken server: the check
// named after its fault fails, with the line that says what a retrying
// client suffers, and (but for noDedup, which breaks several) no other
// check fails.
func TestBrokenServers(t *testing.T) {
	const n = 8
	for _, tc := range []struct {
		name   string
		fault  fault
		failed []string
		says   string
	}{
		{"no de-duplication", noDedup, []string{"replay", "concurrent", "mismatch"},
			"a client that retries a timed-out POST /payments creates a second effect"},
		{"check-then-insert", checkThenInsert, []string{"concurrent"},
			fmt.Sprintf("creates a second effect: %d duplicates sent at once made %d effects", n, n)},
		{"no fingerprint", noFingerprint, []string{"mismatch"},
			"a client that reuses a key for another request (a bug, or a key derived from too little) " +
				"gets the first request's answer"},
		{"scope ignores the principal", globalScope, []string{"scope"},
			"gets that caller's stored answer, and its own request never runs"},
		{"replay regenerates part of the body", regenerate, []string{"replay"},
			`the replay regenerates part of the body (same id "eff_1"; the bodies differ from byte 23)`},
		{"500 on a bad key after the effect ran", lateKeyCheck, []string{"invalid_key"},
			"a client whose key is malformed gets 500 and retries with the same key"},
		{"marker on a first execution", markerOnFirst, []string{"marker"},
			"takes a new effect for the replay of an earlier one"},
		{"in progress for ever", stuck, []string{"in_progress"},
			"a client that honours the conflict's Retry-After does not get its answer"},
		{"keys cut to 255 bytes", truncatedKeys, []string{"invalid_key"},
			"keys are cut to 255 bytes, so two keys that differ after that share one scope"},
		{"malformed keys accepted and ignored", badKeysIgnored, []string{"invalid_key"},
			"a client whose key the server accepts but does not de-duplicate runs its request again on every retry"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := serveFake(t, tc.fault, n)
			rep, err := idemcheck.Run(t.Context(), config(srv.URL, n))
			require.NoError(t, err)
			t.Log("\n" + rep.String())
			require.True(t, rep.Failed())
			var failed []string
			for _, c := range rep.Checks {
				if c.Result == idemcheck.Fail {
					failed = append(failed, c.Name)
					require.NotEmpty(t, c.Evidence, c.Name)
				}
			}
			require.Equal(t, tc.failed, failed)
			for _, c := range rep.Checks {
				if c.Name == tc.failed[0] {
					require.Contains(t, c.Detail, tc.says)
				}
			}
		})
	}
}

// TestCorrectFakePasses shows the broken servers' base is correct: without
// a fault no check fails, so each failure above is its fault's.
func TestCorrectFakePasses(t *testing.T) {
	srv, api := serveFake(t, correct, 8)
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, 8))
	require.NoError(t, err)
	require.False(t, rep.Failed(), rep.String())
	api.mu.Lock()
	defer api.mu.Unlock()
	// Seven effects, and one per extra burst of in_progress (when the
	// concurrent burst saw no conflict).
	extra := 0
	for _, e := range rep.Checks[2].Evidence {
		if strings.HasPrefix(e, "burst ") {
			extra++
		}
	}
	require.Equal(t, 7+extra, api.effects)
}

// constant answers every request 201 with the same body, whatever it
// does: with dedupe false it runs every request, with true it is the
// middleware (two principals).
func constant(t *testing.T, dedupe bool, status int, body string) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(status)
		io.WriteString(w, body)
	})
	if dedupe {
		h = idempotency.New(memstore.New(), idempotency.WithPrincipal(principal),
			idempotency.WithLogger(slog.New(slog.DiscardHandler))).Wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, &runs
}

// When the answers do not identify their effect (the same body for two
// requests under fresh keys), equal answers prove no replay and different
// ones no leak: replay, concurrent and scope are skipped with the reason,
// never passed or failed on body equality alone.
func TestAnswersThatDoNotIdentifyTheEffect(t *testing.T) {
	t.Run("no de-duplication is never a pass", func(t *testing.T) {
		srv, runs := constant(t, false, http.StatusCreated, `{"status":"paid"}`)
		cfg := config(srv.URL, 4)
		cfg.IDField = ""
		rep, err := idemcheck.Run(t.Context(), cfg)
		require.NoError(t, err)
		t.Log("\n" + rep.String())
		res := results(rep)
		for _, name := range []string{"replay", "concurrent", "scope"} {
			require.Equal(t, idemcheck.Skip, res[name], name)
		}
		require.Contains(t, rep.Checks[0].Detail, "the answers do not identify their effect")
		require.Contains(t, rep.Checks[0].Detail, `got the same body {"status":"paid"}`)
		require.Contains(t, rep.Checks[0].Detail, "set IDField (-id-field)")
		require.Greater(t, runs.Load(), int64(4), "every request ran")
	})
	for _, tc := range []struct {
		status int
		body   string
	}{{http.StatusNoContent, ""}, {http.StatusAccepted, `{"status":"accepted"}`}} {
		t.Run(fmt.Sprintf("the middleware answering %d is never a fail", tc.status), func(t *testing.T) {
			srv, _ := constant(t, true, tc.status, tc.body)
			cfg := config(srv.URL, 4)
			cfg.IDField = ""
			rep, err := idemcheck.Run(t.Context(), cfg)
			require.NoError(t, err)
			t.Log("\n" + rep.String())
			require.False(t, rep.Failed())
			require.Equal(t, idemcheck.Skip, results(rep)["scope"])
		})
	}
	t.Run("a leaked replay that differs from the first answer", func(t *testing.T) {
		srv, _ := serveFake(t, leakRegenerated, 4)
		cfg := config(srv.URL, 4)
		cfg.IDField = ""
		rep, err := idemcheck.Run(t.Context(), cfg)
		require.NoError(t, err)
		t.Log("\n" + rep.String())
		require.Equal(t, idemcheck.Fail, results(rep)["scope"])
		require.Contains(t, rep.Checks[4].Detail, "the second principal got a replay (Idempotent-Replayed: true)")
	})
}

// An API that accepts keys keygen refuses (a tab, 256 bytes) and
// de-duplicates them as sent is not failed for it: invalid_key retries
// each and reports (Info) that they replay.
func TestLenientKeysThatDeduplicateAreInfo(t *testing.T) {
	srv, _ := serveFake(t, lenientKeys, 4)
	rep, err := idemcheck.Run(t.Context(), config(srv.URL, 4))
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.False(t, rep.Failed())
	ik := rep.Checks[5]
	require.Equal(t, "invalid_key", ik.Name)
	require.Equal(t, idemcheck.Info, ik.Result)
	require.Contains(t, ik.Detail, "a key with a tab: accepted (201), its retry got the replay")
	require.Contains(t, ik.Detail, "a key of 256 bytes: accepted (201), its retry got the replay")
	require.Contains(t, ik.Detail, "its first 255 bytes are another key")
}
