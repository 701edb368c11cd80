package idempotencytest

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
)

// TestClaimAnswerLost checks, for a store behind a real fault, that a claim
// whose answer is lost (the store ran it, then the connection died) is the
// caller's: arm makes the answer of the next claim be lost so, and lost
// counts the answers lost. A request through the HTTP door, then a call of
// Do, each with its claim's answer lost, runs once and is stored, and its
// retry gets the replay, not an in-progress conflict for a lease that
// nobody holds. s must be empty; the suite's own DoClaimAnswerLost makes
// the same check with a store that fakes the loss.
func TestClaimAnswerLost(t *testing.T, s idempotency.Store, arm func(), lost func() int64) {
	t.Helper()
	mw := idempotency.New(s, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(discard))
	runs := 0
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("paid"))
	}))
	send := func() *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", "claim-lost")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	arm()
	first := send()
	if n := lost(); n != 1 {
		t.Fatalf("the request: %d claims' answers lost, want 1", n)
	}
	wantStatus(t, "the request whose claim's answer was lost", first, http.StatusCreated, true)
	wantStatus(t, "its retry", send(), http.StatusCreated, false)
	if runs != 1 {
		t.Fatalf("the handler ran %d times, want 1", runs)
	}

	calls := 0
	c := idempotency.Call{Operation: "reconcile", Key: "claim-lost"}
	arm()
	res, err := mw.Do(t.Context(), c, counted(&calls, []byte("reconciled")))
	if n := lost(); n != 2 {
		t.Fatalf("the call: %d claims' answers lost in all, want 2", n)
	}
	wantResult(t, "the call whose claim's answer was lost", res, err, []byte("reconciled"), false)
	res, err = mw.Do(t.Context(), c, func(context.Context, *idempotency.Run) ([]byte, error) {
		calls++
		return nil, nil
	})
	wantResult(t, "the next call", res, err, []byte("reconciled"), true)
	if calls != 1 {
		t.Fatalf("fn ran %d times, want 1", calls)
	}
}
