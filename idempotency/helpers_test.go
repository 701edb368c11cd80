package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

var quiet = slog.New(slog.DiscardHandler)

// serve starts an httptest server with mw.Wrap(h) on "POST /payments" and
// "PATCH /payments/{id}" and a pass-through route "GET /payments".
func serve(t *testing.T, store idempotency.Store, h http.Handler, opts ...idempotency.Option) *httptest.Server {
	t.Helper()
	opts = append([]idempotency.Option{idempotency.WithLogger(quiet)}, opts...)
	mw := idempotency.New(store, opts...)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(h))
	mux.Handle("PATCH /payments/{id}", mw.Wrap(h))
	mux.Handle("GET /payments", mw.Wrap(h))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // handler panics are expected in some tests
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

type answer struct {
	Status int
	Header http.Header
	Body   string
}

// do sends one request; key "" sends no key header; extra header lines are
// "Name: value". It sends "Authorization: Bearer test-client" (so the
// default principal is not empty) unless extra sets Authorization; an empty
// value ("Authorization:") sends no Authorization header at all.
func do(t *testing.T, method, url, key, body string, extra ...string) answer {
	t.Helper()
	a, err := tryDo(method, url, key, body, extra...)
	require.NoError(t, err)
	return a
}

func tryDo(method, url, key, body string, extra ...string) (answer, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Authorization", "Bearer test-client")
	authorized := false
	for _, e := range extra {
		name, value, _ := strings.Cut(e, ":")
		if http.CanonicalHeaderKey(name) == "Authorization" && !authorized {
			req.Header.Del(name)
			authorized = true
		}
		if value = strings.TrimSpace(value); value != "" || http.CanonicalHeaderKey(name) != "Authorization" {
			req.Header.Add(name, value)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	return answer{resp.StatusCode, resp.Header, string(b)}, nil
}

func post(t *testing.T, srv *httptest.Server, key, body string, extra ...string) answer {
	t.Helper()
	return do(t, http.MethodPost, srv.URL+"/payments", key, body, extra...)
}

// problem is the problem+json body of the middleware's own answers, as
// docs/CONTRACT.md describes it.
type problem struct {
	Type           string           `json:"type"`
	Title          string           `json:"title"`
	Status         int              `json:"status"`
	Code           idempotency.Code `json:"code"`
	Detail         string           `json:"detail"`
	OriginalStatus int              `json:"original_status"`
}

// requireProblem checks a problem+json answer and returns it.
func requireProblem(t *testing.T, a answer, status int, code idempotency.Code) problem {
	t.Helper()
	require.Equal(t, status, a.Status, "body: %s", a.Body)
	require.Equal(t, "application/problem+json", a.Header.Get("Content-Type"))
	require.Equal(t, "no-store", a.Header.Get("Cache-Control"))
	var p problem
	require.NoError(t, json.Unmarshal([]byte(a.Body), &p), a.Body)
	require.Equal(t, code, p.Code)
	require.Equal(t, status, p.Status)
	require.Equal(t, "https://saferetry.dev/problems/"+string(code), p.Type)
	require.NotEmpty(t, p.Title)
	require.Empty(t, a.Header.Get(idempotency.ReplayedHeader))
	return p
}

func requireReplay(t *testing.T, a, first answer) {
	t.Helper()
	require.Equal(t, first.Status, a.Status, "body: %s", a.Body)
	require.Equal(t, first.Body, a.Body)
	require.Equal(t, "true", a.Header.Get(idempotency.ReplayedHeader))
}

func requireFresh(t *testing.T, a answer) {
	t.Helper()
	require.Empty(t, a.Header.Get(idempotency.ReplayedHeader), "unexpected replay: %d %s", a.Status, a.Body)
}

// failingStore fails every call with errStore.
type failingStore struct{}

var errStore = errors.New("store down")

func (failingStore) Claim(context.Context, idempotency.Claim) (idempotency.ClaimResult, error) {
	return idempotency.ClaimResult{}, errStore
}
func (failingStore) Get(context.Context, idempotency.Scope) (idempotency.Record, error) {
	return idempotency.Record{}, errStore
}
func (failingStore) Heartbeat(context.Context, idempotency.Lease, time.Time) error { return errStore }
func (failingStore) Complete(context.Context, idempotency.Lease, idempotency.Response, time.Time) error {
	return errStore
}
func (failingStore) Release(context.Context, idempotency.Lease) error { return errStore }
func (failingStore) SetRecoveryPoint(context.Context, idempotency.Lease, string, []byte, time.Time) error {
	return errStore
}
func (failingStore) Abandoned(context.Context, time.Time, int) ([]idempotency.Record, error) {
	return nil, errStore
}
func (failingStore) DeleteBefore(context.Context, time.Time, int) (int, error) { return 0, errStore }

// plainStore hides a store's Transactor methods.
type plainStore struct{ idempotency.Store }

// failingBegin is a memstore whose Begin fails.
type failingBegin struct{ *memstore.Store }

func (failingBegin) Begin(context.Context, idempotency.Lease) (idempotency.Unit, context.Context, error) {
	return nil, nil, errStore
}

const (
	timeout = 10 * time.Second
	tick    = time.Millisecond
)

// send serves one guarded POST /payments through h in process (no
// network, so that it runs in a testing/synctest bubble too). It sends no
// credentials: give h WithAnonymousKeys(true).
func send(t *testing.T, h http.Handler, key, body string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}
