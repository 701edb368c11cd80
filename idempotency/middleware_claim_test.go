package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// slowClaimStore commits a claim, then reports the caller's cancellation if
// it happens within a short window, as a database driver does when the
// context is canceled while the statement's result is on its way back.
type slowClaimStore struct {
	*memstore.Store
	claimed chan struct{}
}

func (s *slowClaimStore) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, c)
	close(s.claimed)
	select {
	case <-ctx.Done():
		return idempotency.ClaimResult{}, ctx.Err()
	case <-time.After(200 * time.Millisecond):
	}
	return res, err
}

// A client that goes away while its claim is being committed must not leave
// the key in progress with no owner: the next request with the key gets an
// answer (the replay of the run that went ahead), not a 409 for a lease
// nobody renews.
func TestClaimSurvivesClientDisconnect(t *testing.T) {
	store := &slowClaimStore{Store: memstore.New(), claimed: make(chan struct{})}
	ran := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.WriteHeader(http.StatusCreated)
	})
	mw := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(h)

	ctx, cancel := context.WithCancel(context.Background())
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1}`)).WithContext(ctx)
	req.Header.Set("Idempotency-Key", "k-disconnect")
	canceled := make(chan struct{})
	go func() { <-store.claimed; cancel(); close(canceled) }()
	mw.ServeHTTP(httptest.NewRecorder(), req)
	<-canceled // before store.claimed is replaced below

	rec, err := store.Get(context.Background(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k-disconnect"})
	require.NoError(t, err)
	assert.Equal(t, idempotency.Completed, rec.State, "the claim was used, not orphaned in progress")
	assert.Equal(t, 1, ran)

	again := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1}`))
	again.Header.Set("Idempotency-Key", "k-disconnect")
	store.claimed = make(chan struct{})
	w := httptest.NewRecorder()
	mw.ServeHTTP(w, again)
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.Equal(t, "true", w.Header().Get(idempotency.ReplayedHeader))
	assert.Equal(t, 1, ran)
}

// deadlineStore records whether its claims were given a deadline.
type deadlineStore struct {
	*memstore.Store
	hadDeadline atomic.Bool
}

func (s *deadlineStore) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	_, ok := ctx.Deadline()
	s.hadDeadline.Store(ok)
	return s.Store.Claim(ctx, c)
}

// Only memstore.Store itself goes without store timeouts: a store that
// embeds it (a wrapper that may add I/O) keeps them.
func TestAStoreEmbeddingTheMemstoreKeepsTheStoreTimeout(t *testing.T) {
	store := &deadlineStore{Store: memstore.New()}
	mw := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLogger(quiet)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":1}`))
	req.Header.Set("Idempotency-Key", "k-timeout")
	w := httptest.NewRecorder()
	mw.ServeHTTP(w, req)
	require.Equal(t, http.StatusCreated, w.Code)
	assert.True(t, store.hadDeadline.Load())
}
