package idempotency_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// What an operator must see is logged at Warn: a key reused for a
// different request (a client bug), and a response too large to be stored
// for replay (its retries will get 409). A replay and an in-progress 409
// are the contract working: Debug.
func TestOperatorLogs(t *testing.T) {
	log, buf := bufLogger()
	entered, release := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get("Idempotency-Key") {
		case "big":
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte(strings.Repeat("x", 100)))
		case "slow":
			close(entered)
			<-release
			w.WriteHeader(http.StatusCreated)
		default:
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte("ok"))
		}
	})
	g := idempotency.New(memstore.New(), idempotency.WithLogger(log), idempotency.WithMaxStoredBody(8),
		idempotency.WithAnonymousKeys(true)).Wrap(h)
	warnings := func() []string {
		var out []string
		for _, l := range strings.Split(buf.String(), "\n") {
			if strings.HasPrefix(l, "level=WARN") || strings.HasPrefix(l, "level=ERROR") {
				out = append(out, l)
			}
		}
		buf.Reset()
		return out
	}

	first := send(t, g, "k", `{"amount":1}`)
	again := send(t, g, "k", `{"amount":1}`)
	require.Equal(t, "true", again.Header().Get(idempotency.ReplayedHeader))
	require.Equal(t, first.Body.String(), again.Body.String())
	require.Contains(t, buf.String(), `level=DEBUG msg="idempotency: replayed the stored response"`)
	require.Empty(t, warnings(), "a request and its replay")

	require.Equal(t, http.StatusUnprocessableEntity, send(t, g, "k", `{"amount":2}`).Code)
	w := warnings()
	require.Len(t, w, 1)
	require.Contains(t, w[0], `msg="idempotency: a key was reused for a different request`)
	require.Contains(t, w[0], "code=idempotency_key_reused")
	require.NotContains(t, w[0], "key=k", "no raw key")

	done := make(chan int)
	go func() { done <- send(t, g, "slow", `{}`).Code }()
	<-entered
	require.Equal(t, http.StatusConflict, send(t, g, "slow", `{}`).Code)
	close(release)
	require.Equal(t, http.StatusCreated, <-done)
	require.Contains(t, buf.String(), `level=DEBUG msg="idempotency: refused"`)
	require.Empty(t, warnings(), "an in-progress 409")

	require.Equal(t, http.StatusCreated, send(t, g, "big", `{}`).Code)
	w = warnings()
	require.Len(t, w, 1)
	require.Contains(t, w[0], `msg="idempotency: the response (or output) is too large to be stored for replay`)
	require.Equal(t, http.StatusConflict, send(t, g, "big", `{}`).Code)
	require.Empty(t, warnings(), "the replays of a response too large to store")
}
