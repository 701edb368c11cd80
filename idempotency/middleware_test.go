package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// payments is a handler whose side effect is a counter; it answers 201 with
// the payment number and the body it read.
type payments struct {
	n    atomic.Int64
	gate chan struct{} // when non-nil, the handler waits for it before answering
}

func (p *payments) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.n.Add(1)
	body, _ := io.ReadAll(r.Body)
	if p.gate != nil {
		<-p.gate
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", n))
	w.Header().Set("Set-Cookie", "session=secret")
	w.Header().Set("X-Request-Id", fmt.Sprintf("req-%d", n))
	w.Header().Set("X-Balance", "100")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"payment":%d,"request":%s}`, n, body)
}

// 200 concurrent requests with one key and body: one
// execution; every other answer is the in-progress 409 or a replay identical
// to the first; the in-progress ones retried afterwards get the replay.
func TestConcurrentRequestsOneExecution(t *testing.T) {
	const n = 200
	h := &payments{gate: make(chan struct{})}
	srv := serve(t, memstore.New(), h)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	t.Cleanup(client.CloseIdleConnections)

	var answered atomic.Int64
	var once sync.Once
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":100}`))
			req.Header.Set("Idempotency-Key", "pay-200")
			req.Header.Set("Authorization", "Bearer test-client")
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				answers[i] = answer{Body: err.Error()}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers[i] = answer{resp.StatusCode, resp.Header, string(b)}
			// Let the one execution finish once half the others have
			// their answer; the rest race with the completion.
			if answered.Add(1) >= n/2 {
				once.Do(func() { close(h.gate) })
			}
		}()
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, h.n.Load(), "side effect ran more than once")

	var first answer
	var conflicts, replays []int
	for i, a := range answers {
		switch {
		case a.Status == http.StatusCreated && a.Header.Get(idempotency.ReplayedHeader) == "":
			require.Zero(t, first.Status, "two fresh 201s")
			first = a
		case a.Status == http.StatusConflict:
			requireProblem(t, a, http.StatusConflict, idempotency.CodeInProgress)
			require.Equal(t, "1", a.Header.Get("Retry-After"))
			conflicts = append(conflicts, i)
		default:
			replays = append(replays, i)
		}
	}
	require.Equal(t, http.StatusCreated, first.Status, "no fresh execution among the answers")
	for _, i := range replays {
		requireReplay(t, answers[i], first)
	}
	require.Equal(t, n-1, len(conflicts)+len(replays))
	require.GreaterOrEqual(t, len(conflicts), n/2-1)
	// The conflicts retry with the same key and get the replay.
	for range conflicts[:10] {
		requireReplay(t, post(t, srv, "pay-200", `{"amount":100}`), first)
	}
	require.EqualValues(t, 1, h.n.Load())
}

// Same key, different body: 422 idempotency_key_reused.
func TestKeyReusedWithDifferentBody(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h)
	first := post(t, srv, "k-422", `{"amount":100,"currency":"EUR"}`)
	require.Equal(t, http.StatusCreated, first.Status)

	// Same JSON with keys reordered and other whitespace: the same request.
	requireReplay(t, post(t, srv, "k-422", "{ \"currency\": \"EUR\",\n \"amount\": 100 }"), first)

	a := post(t, srv, "k-422", `{"amount":200,"currency":"EUR"}`)
	p := requireProblem(t, a, http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	require.NotEmpty(t, p.Detail)
	// Another path under the same pattern is a different request too.
	a = do(t, http.MethodPatch, srv.URL+"/payments/1", "k-patch", `{}`)
	require.Equal(t, http.StatusCreated, a.Status)
	a = do(t, http.MethodPatch, srv.URL+"/payments/2", "k-patch", `{}`)
	requireProblem(t, a, http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	require.EqualValues(t, 2, h.n.Load())

	srv409 := serve(t, memstore.New(), h, idempotency.WithMismatchStatus(http.StatusConflict))
	post(t, srv409, "k", `{"amount":1}`)
	requireProblem(t, post(t, srv409, "k", `{"amount":2}`), http.StatusConflict, idempotency.CodeKeyReused)
}

// A different body while the first is still running is a reuse too, not
// an in-progress conflict.
func TestKeyReusedWhileInProgress(t *testing.T) {
	h := &payments{gate: make(chan struct{})}
	srv := serve(t, memstore.New(), h)
	done := make(chan answer)
	go func() {
		a, _ := tryDo(http.MethodPost, srv.URL+"/payments", "k", `{"amount":1}`)
		done <- a
	}()
	require.Eventually(t, func() bool { return h.n.Load() == 1 }, timeout, tick)
	requireProblem(t, post(t, srv, "k", `{"amount":2}`), http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	requireProblem(t, post(t, srv, "k", `{"amount":1}`), http.StatusConflict, idempotency.CodeInProgress)
	close(h.gate)
	require.Equal(t, http.StatusCreated, (<-done).Status)
}

// Principal B reusing principal A's key runs on its own.
func TestPrincipalIsolation(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h, idempotency.WithPrincipal(func(r *http.Request) (string, error) {
		return r.Header.Get("X-Account"), nil
	}))
	a1 := post(t, srv, "shared", `{"amount":5}`, "X-Account: alice")
	b1 := post(t, srv, "shared", `{"amount":5}`, "X-Account: bob")
	requireFresh(t, b1)
	require.Equal(t, http.StatusCreated, b1.Status)
	require.NotEqual(t, a1.Body, b1.Body)
	require.EqualValues(t, 2, h.n.Load())
	requireReplay(t, post(t, srv, "shared", `{"amount":5}`, "X-Account: alice"), a1)
	requireReplay(t, post(t, srv, "shared", `{"amount":5}`, "X-Account: bob"), b1)
	// Bob reusing the key with another body only conflicts with his own.
	requireProblem(t, post(t, srv, "shared", `{"amount":6}`, "X-Account: bob"), http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
}

// The default principal is a digest of the Authorization header.
func TestDefaultPrincipalAuthorizationDigest(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h)
	a := post(t, srv, "k", `{}`, "Authorization: Bearer alice")
	requireFresh(t, post(t, srv, "k", `{}`, "Authorization: Bearer bob"))
	requireProblem(t, post(t, srv, "k", `{}`, "Authorization:"), http.StatusUnauthorized, idempotency.CodePrincipalMissing)
	requireReplay(t, post(t, srv, "k", `{}`, "Authorization: Bearer alice"), a)
	require.EqualValues(t, 2, h.n.Load())

}

// An Authorization header that carries no credential identifies nobody:
// empty, blank, or an authentication scheme alone ("Bearer"). By default
// such a request has no principal and its key is refused, instead of every
// such caller sharing one scope (the digest of "" or of "Bearer").
func TestAuthorizationWithoutCredentialIsNoPrincipal(t *testing.T) {
	h := &payments{}
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
	do := func(vals []string) answer {
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{}`))
		r.Header["Authorization"] = vals
		r.Header.Set("Idempotency-Key", "k-"+strings.Join(vals, "|"))
		w := httptest.NewRecorder()
		mw.Wrap(h).ServeHTTP(w, r)
		return answer{w.Code, w.Header(), w.Body.String()}
	}
	for _, vals := range [][]string{{""}, {"   "}, {"\t"}, {"", " "}, {"Bearer"}, {" bearer "}, {"Basic"},
		{"Bearer", ""}, {"Digest"}, {"Negotiate"}, {"DPoP"}, {"Token"}} {
		requireProblem(t, do(vals), http.StatusUnauthorized, idempotency.CodePrincipalMissing)
	}
	require.Zero(t, h.n.Load(), "the handler never ran")
	// A credential, with a scheme or without one, is a principal.
	for _, vals := range [][]string{{"Bearer x"}, {"Basic YWxpY2U6"}, {"sk_live_123"}, {"Bearer", "Bearer x"}} {
		require.Equal(t, http.StatusCreated, do(vals).Status, vals)
	}
}

// WithAnonymousKeys is the explicit opt-in to one shared scope: every
// caller without a principal shares the scope "", so the second anonymous
// caller with the first one's key gets the first one's stored response.
func TestWithAnonymousKeysSharesOneScope(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h, idempotency.WithAnonymousKeys(true))
	first := post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization:")
	require.Equal(t, http.StatusCreated, first.Status, first.Body)
	requireFresh(t, first)
	requireReplay(t, post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization:"), first)
	require.EqualValues(t, 1, h.n.Load())
	// Identified callers keep scopes of their own.
	requireFresh(t, post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization: Bearer alice"))
	require.EqualValues(t, 2, h.n.Load())
}

// The principal function tells a refusal from an outage: an error wrapping
// ErrPrincipalRefused (bad credentials) is 401 CodePrincipalRefused, which
// a client does not retry; any other error (the authentication backend is
// down) is a server failure, 503 CodePrincipalUnavailable with
// Retry-After: 1, which a client retries with the same key, logged at
// Error. Nothing runs either way, and the observers get the error.
func TestPrincipalRefusalAndOutage(t *testing.T) {
	refused := fmt.Errorf("token expired: %w", idempotency.ErrPrincipalRefused)
	for _, tc := range []struct {
		err    error
		status int
		code   idempotency.Code
		log    string
	}{
		{refused, http.StatusUnauthorized, idempotency.CodePrincipalRefused, ""},
		{errStore, http.StatusServiceUnavailable, idempotency.CodePrincipalUnavailable,
			`level=ERROR msg="idempotency: the principal function failed; guarded requests are refused with 503"`},
	} {
		t.Run(string(tc.code), func(t *testing.T) {
			h := &payments{}
			s := &seen{}
			log, buf := bufLogger()
			srv := serve(t, memstore.New(), h, idempotency.WithPrincipal(func(*http.Request) (string, error) {
				return "", tc.err
			}), idempotency.WithObserver(s.observer()), idempotency.WithLogger(log))
			a := post(t, srv, "k", `{}`)
			requireProblem(t, a, tc.status, tc.code)
			if tc.status == http.StatusServiceUnavailable {
				require.Equal(t, "1", a.Header.Get("Retry-After"))
			} else {
				require.Empty(t, a.Header.Get("Retry-After"))
			}
			require.Zero(t, h.n.Load())
			_, by := s.take()
			require.ErrorIs(t, by["refused"][0].Err, tc.err)
			if tc.log != "" {
				require.Contains(t, buf.String(), tc.log)
			} else {
				require.NotContains(t, buf.String(), "level=ERROR")
			}
		})
	}
}

// Key formats.
func TestKeyFormats(t *testing.T) {
	var seen atomic.Value
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, ok := idempotency.FromContext(r.Context())
		if ok {
			seen.Store(run.Scope.Key)
		}
		w.WriteHeader(http.StatusCreated)
	})
	srv := serve(t, memstore.New(), h)
	for _, tc := range []struct{ header, key string }{
		{"abc-123", "abc-123"},
		{`"abc-456"`, "abc-456"},
		{`"a\"b\\c"`, `a"b\c`},
		{"  padded  ", "padded"},
		{strings.Repeat("k", 255), strings.Repeat("k", 255)},
		// Bare values are the key as they are: inner spaces, commas,
		// quotes.
		{"order 42", "order 42"},
		{`"a b"`, "a b"},
		{"a, b", "a, b"},
		{"a,b", "a,b"},
		{`"abc`, `"abc`},
		{`ab"c`, `ab"c`},
	} {
		t.Run(tc.header, func(t *testing.T) {
			a := post(t, srv, tc.header, `{}`)
			require.Equal(t, http.StatusCreated, a.Status, a.Body)
			require.Equal(t, tc.key, seen.Load())
		})
	}
	// The bare and the quoted spelling of one key are the same key.
	requireReplay(t, post(t, srv, "abc-123", `{}`), answer{Status: http.StatusCreated})

	for name, extra := range map[string][]string{
		"256 characters":              {"Idempotency-Key: " + strings.Repeat("k", 256)},
		"empty":                       {"Idempotency-Key: "},
		"empty string":                {`Idempotency-Key: ""`},
		"quoted list":                 {`Idempotency-Key: "a", "b"`},
		"two lines":                   {"Idempotency-Key: a", "Idempotency-Key: b"},
		"non-ASCII":                   {"Idempotency-Key: caf\u00e9"},
		"tab inside":                  {"Idempotency-Key: a\tb"},
		"outer space in an sf-string": {`Idempotency-Key: " a"`},
		"bad escape":                  {`Idempotency-Key: "a\n"`},
	} {
		t.Run(name, func(t *testing.T) {
			seen.Store("")
			a := post(t, srv, "", `{}`, extra...)
			p := requireProblem(t, a, http.StatusBadRequest, idempotency.CodeKeyInvalid)
			require.NotEmpty(t, p.Detail)
			require.Equal(t, "", seen.Load(), "the handler ran")
		})
	}
}

// Which statuses are stored and replayed, and which release
// the key so that a retry executes again. One subtest per status.
func TestStoredAndReleasedStatuses(t *testing.T) {
	for _, tc := range []struct {
		status int
		stored bool
	}{
		{200, true}, {201, true}, {202, true}, {204, true}, {303, true},
		{400, true}, {404, true}, {422, true},
		{408, false}, {409, false}, {425, false}, {429, false},
		{500, false}, {502, false}, {503, false}, {504, false},
	} {
		t.Run(fmt.Sprint(tc.status), func(t *testing.T) {
			var n atomic.Int64
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				i := n.Add(1)
				w.Header().Set("Content-Type", "text/plain")
				if tc.status == 303 {
					w.Header().Set("Location", "/payments/1")
				}
				w.WriteHeader(tc.status)
				if tc.status != 204 {
					fmt.Fprintf(w, "execution %d", i)
				}
			})
			store := memstore.New()
			srv := serve(t, store, h)
			client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
			send := func() answer {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{}`))
				req.Header.Set("Idempotency-Key", "k")
				req.Header.Set("Authorization", "Bearer test-client")
				resp, err := client.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return answer{resp.StatusCode, resp.Header, string(b)}
			}
			first := send()
			require.Equal(t, tc.status, first.Status)
			requireFresh(t, first)
			second := send()
			if tc.stored {
				requireReplay(t, second, first)
				require.EqualValues(t, 1, n.Load())
				if tc.status == 303 {
					require.Equal(t, "/payments/1", second.Header.Get("Location"))
				}
			} else {
				requireFresh(t, second)
				require.Equal(t, tc.status, second.Status)
				require.Equal(t, "execution 2", second.Body)
				require.EqualValues(t, 2, n.Load())
				require.Equal(t, 0, store.Len(), "a released key left a record")
			}
		})
	}
	t.Run("panic", func(t *testing.T) {
		var n atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if n.Add(1) == 1 {
				w.WriteHeader(http.StatusCreated) // buffered: never reaches the client
				panic("boom")
			}
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "second")
		})
		store := memstore.New()
		srv := serve(t, store, h)
		_, err := tryDo(http.MethodPost, srv.URL+"/payments", "k", `{}`)
		require.Error(t, err, "net/http drops the connection of a panicking handler")
		require.Equal(t, 0, store.Len())
		a := post(t, srv, "k", `{}`)
		require.Equal(t, http.StatusCreated, a.Status)
		require.Equal(t, "second", a.Body)
		requireReplay(t, post(t, srv, "k", `{}`), a)
		require.EqualValues(t, 2, n.Load())
	})
	t.Run("5xx stored with WithStore5xx", func(t *testing.T) {
		var n atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n.Add(1)
			http.Error(w, "down", http.StatusInternalServerError)
		})
		srv := serve(t, memstore.New(), h, idempotency.WithStore5xx(true))
		first := post(t, srv, "k", `{}`)
		require.Equal(t, http.StatusInternalServerError, first.Status)
		requireReplay(t, post(t, srv, "k", `{}`), first)
		require.EqualValues(t, 1, n.Load())
	})
}

// A 5xx after a committed recovery point keeps the record in progress with
// its lease ended: the retry takes over at once and resumes from the point.
func TestFailureAfterRecoveryPointResumes(t *testing.T) {
	store := memstore.New()
	var calls atomic.Int64
	var resumedFrom atomic.Value
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, ok := idempotency.FromContext(r.Context())
		if !ok {
			http.Error(w, "no run", http.StatusTeapot)
			return
		}
		if calls.Add(1) == 1 {
			if err := store.SetRecoveryPoint(r.Context(), run.Lease, "order-created", []byte("order-7"), time.Now()); err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			http.Error(w, "card processor down", http.StatusBadGateway)
			return
		}
		resumedFrom.Store(run.RecoveryPoint)
		w.WriteHeader(http.StatusCreated)
	})
	srv := serve(t, store, h)
	first := post(t, srv, "k", `{}`)
	require.Equal(t, http.StatusBadGateway, first.Status)
	require.Equal(t, 1, store.Len(), "the record must survive a failure after a recovery point")
	// A different request cannot steal the key meanwhile.
	requireProblem(t, post(t, srv, "k", `{"other":1}`), http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	second := post(t, srv, "k", `{}`)
	require.Equal(t, http.StatusCreated, second.Status, second.Body)
	require.Equal(t, "order-created", resumedFrom.Load())
	requireReplay(t, post(t, srv, "k", `{}`), second)
	require.EqualValues(t, 2, calls.Load())
}

// A failing store gives 503 and the handler never runs.
func TestFailingStore(t *testing.T) {
	for name, store := range map[string]idempotency.Store{
		"claim fails": failingStore{},
		"nil store":   nil,
	} {
		t.Run(name, func(t *testing.T) {
			h := &payments{}
			srv := serve(t, store, h)
			requireProblem(t, post(t, srv, "k", `{}`), http.StatusServiceUnavailable, idempotency.CodeStoreUnavailable)
			require.Zero(t, h.n.Load(), "the handler ran unprotected")
		})
	}
}

// The request's unit is begun lazily: a store whose Begin fails lets the
// handler run under its claim. When the handler asked for its unit (and got
// the error), the answer is 503, the key is released and nothing of the
// handler's response is sent. When it never asked, no unit is begun at all:
// the completion is one Store.Complete, and the response is stored and sent.
func TestBeginFailure(t *testing.T) {
	for _, asks := range []bool{false, true} {
		t.Run(fmt.Sprintf("handler asks=%v", asks), func(t *testing.T) {
			store := failingBegin{memstore.New()}
			var unitErr, phaseErr atomic.Value
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run, _ := idempotency.FromContext(r.Context())
				if asks {
					_, err := run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return nil, nil })
					phaseErr.Store(err)
					_, _, err = run.Unit(r.Context())
					unitErr.Store(err)
					_, _, err = run.Unit(r.Context()) // the error is kept
					require.ErrorIs(t, err, errStore)
				}
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, "secret result")
			})
			srv := serve(t, store, h)
			a := post(t, srv, "k", `{}`)
			if !asks {
				require.Equal(t, http.StatusCreated, a.Status)
				require.Equal(t, "secret result", a.Body)
				replay := post(t, srv, "k", `{}`)
				require.Equal(t, "true", replay.Header.Get(idempotency.ReplayedHeader), "the response was stored without a unit")
				return
			}
			requireProblem(t, a, http.StatusServiceUnavailable, idempotency.CodeStoreUnavailable)
			require.NotContains(t, a.Body, "secret result")
			require.Equal(t, 0, store.Len(), "the claim was not released")
			require.ErrorIs(t, unitErr.Load().(error), errStore)
			var pe *idempotency.PhaseError
			require.ErrorAs(t, phaseErr.Load().(error), &pe)
			require.Equal(t, "begin", pe.Step)
			require.ErrorIs(t, pe, errStore)
		})
	}
}

// A store that fails at completion: with a Transactor nothing commits and
// the client gets 503 (and none of the handler's response).
type failingCommit struct{ *memstore.Store }

type failingUnit struct{ idempotency.Unit }

func (failingUnit) Commit() error { return errStore }

func (f failingCommit) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit, context.Context, error) {
	u, c, err := f.Store.Begin(ctx, l)
	return failingUnit{u}, c, err
}

func TestCommitFailureAnswers503(t *testing.T) {
	store := failingCommit{memstore.New()}
	p := &payments{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := idempotency.FromContext(r.Context())
		_, _, err := run.Unit(r.Context()) // the handler writes through its unit
		require.NoError(t, err)
		p.ServeHTTP(w, r)
	})
	srv := serve(t, store, h)
	a := post(t, srv, "k", `{}`)
	requireProblem(t, a, http.StatusServiceUnavailable, idempotency.CodeStoreUnavailable)
	require.NotContains(t, a.Body, "payment")
	require.Equal(t, 0, store.Len(), "the uncommitted claim was not released")
}

func TestPassThrough(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h)
	// Unguarded method, even with a key: no record, no replay.
	for range 2 {
		requireFresh(t, do(t, http.MethodGet, srv.URL+"/payments", "k", ""))
	}
	// Guarded method without a key.
	for range 2 {
		requireFresh(t, post(t, srv, "", `{}`))
	}
	require.EqualValues(t, 4, h.n.Load())

	srvReq := serve(t, memstore.New(), h, idempotency.WithKeyRequired(true))
	requireProblem(t, post(t, srvReq, "", `{}`), http.StatusBadRequest, idempotency.CodeKeyMissing)
	require.EqualValues(t, 4, h.n.Load())

	// WithMethods guards GET instead.
	srvGet := serve(t, memstore.New(), h, idempotency.WithMethods("get"))
	first := do(t, http.MethodGet, srvGet.URL+"/payments", "k", "")
	requireReplay(t, do(t, http.MethodGet, srvGet.URL+"/payments", "k", ""), first)
	requireFresh(t, post(t, srvGet, "k", `{}`))
}

func TestReplayHeaders(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h)
	first := post(t, srv, "k", `{"a":1}`)
	require.Equal(t, "session=secret", first.Header.Get("Set-Cookie"), "the first client gets every header")
	require.Equal(t, "req-1", first.Header.Get("X-Request-Id"))
	r := post(t, srv, "k", `{"a":1}`)
	requireReplay(t, r, first)
	require.Equal(t, "/payments/1", r.Header.Get("Location"))
	require.Equal(t, "application/json", r.Header.Get("Content-Type"))
	require.Empty(t, r.Header.Get("Set-Cookie"))
	require.Empty(t, r.Header.Get("X-Request-Id"))
	require.NotEqual(t, first.Header.Get("Date"), "", "net/http sets Date")

	require.Empty(t, r.Header.Get("X-Balance"))

	// Headers added to the allow-list are replayed too, but Set-Cookie and
	// per-exchange ids never are.
	srv2 := serve(t, memstore.New(), h, idempotency.WithReplayHeaders("x-balance", "X-Request-Id", "Set-Cookie"))
	post(t, srv2, "k", `{}`)
	r = post(t, srv2, "k", `{}`)
	require.Empty(t, r.Header.Get("Set-Cookie"))
	require.Empty(t, r.Header.Get("X-Request-Id"))
	require.Equal(t, "100", r.Header.Get("X-Balance"))
	require.NotEmpty(t, r.Header.Get("Location"), "the defaults stay")
}

// The stored headers are nobody else's: what the handler does to its value
// slices after it returned, or a caller of the writer to the header map it
// got, cannot change a replay.
func TestStoredHeadersAreNobodyElses(t *testing.T) {
	ct := []string{"application/json"} // the handler's own slice, reused after it returns
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = ct
		w.Header().Set("Location", "/payments/1")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":1}`)
	})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet)).Wrap(h)
	send := func() *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"a":1}`))
		r.Header.Set("Idempotency-Key", "k")
		r.Header.Set("Authorization", "Bearer test-client")
		w := httptest.NewRecorder()
		mw.ServeHTTP(w, r)
		return w
	}
	first := send()
	require.Equal(t, http.StatusCreated, first.Code)
	ct[0] = "text/html"
	first.Header()["Location"][0] = "/elsewhere"
	replay := send()
	require.Equal(t, "true", replay.Header().Get(idempotency.ReplayedHeader))
	require.Equal(t, "application/json", replay.Header().Get("Content-Type"))
	require.Equal(t, "/payments/1", replay.Header().Get("Location"))
}

func TestRequestBodyLimit(t *testing.T) {
	var got atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.Store(int64(len(b)))
		w.WriteHeader(http.StatusCreated)
	})
	srv := serve(t, memstore.New(), h, idempotency.WithMaxRequestBody(100))
	a := post(t, srv, "k1", strings.Repeat("x", 100))
	require.Equal(t, http.StatusCreated, a.Status)
	require.EqualValues(t, 100, got.Load(), "the handler must get the full body")
	requireProblem(t, post(t, srv, "k2", strings.Repeat("x", 101)), http.StatusRequestEntityTooLarge, idempotency.CodeRequestTooLarge)
	require.EqualValues(t, 100, got.Load())
}

func TestStoredBodyCap(t *testing.T) {
	var n atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, strings.Repeat("y", 64))
	})
	srv := serve(t, memstore.New(), h, idempotency.WithMaxStoredBody(63))
	first := post(t, srv, "k", `{}`)
	require.Equal(t, http.StatusCreated, first.Status)
	require.Len(t, first.Body, 64, "the first client gets the whole body")
	require.Empty(t, first.Header.Get("Saferetry-Not-Replayable"), "the store's marker never reaches a client")
	p := requireProblem(t, post(t, srv, "k", `{}`), http.StatusConflict, idempotency.CodeResponseNotReplayable)
	require.Equal(t, http.StatusCreated, p.OriginalStatus)
	require.EqualValues(t, 1, n.Load(), "the work must not run again")
}

// The capture writer: Flush is deferred until after the commit, Unwrap
// reaches the server's writer, and implicit 200s are stored.
func TestCaptureWriter(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, isFlusher := w.(http.Flusher)
		u, hasUnwrap := w.(interface{ Unwrap() http.ResponseWriter })
		io.WriteString(w, fmt.Sprintf("flusher=%v unwrap=%v", isFlusher, hasUnwrap && u.Unwrap() != nil))
		err := http.NewResponseController(w).Flush()
		io.WriteString(w, fmt.Sprintf(" flush=%v", err))
	})
	srv := serve(t, memstore.New(), h)
	first := post(t, srv, "k", `{}`)
	require.Equal(t, http.StatusOK, first.Status)
	require.Equal(t, "flusher=true unwrap=true flush=<nil>", first.Body)
	requireReplay(t, post(t, srv, "k", `{}`), first)
}

// A plain (non-Transactor) store works the same.
func TestPlainStore(t *testing.T) {
	h := &payments{}
	srv := serve(t, plainStore{memstore.New()}, h)
	first := post(t, srv, "k", `{}`)
	require.Equal(t, http.StatusCreated, first.Status)
	requireReplay(t, post(t, srv, "k", `{}`), first)
	require.EqualValues(t, 1, h.n.Load())
}

// Handlers see their Run, and with a Transactor store the Unit.
func TestFromContext(t *testing.T) {
	var (
		run     *idempotency.Run
		unit    idempotency.Unit
		unitErr error
		rec     idempotency.Record // as the handler runs
		recErr  error
	)
	store := memstore.New()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ = idempotency.FromContext(r.Context())
		unit, _, unitErr = run.Unit(r.Context())
		rec, recErr = store.Get(r.Context(), run.Scope)
	})
	srv := serve(t, store, h)
	post(t, srv, "k", `{"a":1}`, "Authorization: Bearer secret")
	require.NoError(t, recErr)
	require.Equal(t, string(idempotency.StoredRequest("POST", "/payments", strings.TrimPrefix(srv.URL, "http://"),
		"application/json", []byte(`{"a":1}`))), string(rec.Request))
	require.NoError(t, unitErr)
	require.NotNil(t, unit, "a Transactor store gives the handler its unit")
	_, _, err := run.Unit(t.Context())
	require.ErrorIs(t, err, idempotency.ErrMisuse, "the run ends with its handler")
	require.NotContains(t, string(rec.Request), "secret", "credentials must not reach the store")
	require.NotNil(t, run)
	require.Equal(t, idempotency.Scope{Principal: run.Scope.Principal, Method: "POST", Route: "POST /payments", Key: "k"}, run.Scope)
	require.EqualValues(t, 1, run.Lease.Generation)
	require.NotEmpty(t, run.Lease.Owner)
	require.True(t, strings.HasPrefix(run.Scope.Principal, "authz:"))
	_, ok := idempotency.FromContext(t.Context())
	require.False(t, ok)
}

// The handler's context keeps the request's values and deadline and
// carries the Run, but once the key is claimed the client going away does
// not cancel it: only the deadline (or a lost lease, or
// WithShutdown) ends it. Fake time: the one-hour deadline passes at once.
func TestHandlerContextOutlivesTheClient(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		type key struct{}
		deadline := time.Now().Add(time.Hour)
		got := make(chan error, 1)
		h := idempotency.New(memstore.New(), idempotency.WithLogger(quiet)).Wrap(http.HandlerFunc(
			func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				d, ok := ctx.Deadline()
				_, hasRun := idempotency.FromContext(ctx)
				if !ok || !d.Equal(deadline) || ctx.Value(key{}) != "v" || !hasRun {
					got <- fmt.Errorf("deadline %v %v, value %v, run %v", d, ok, ctx.Value(key{}), hasRun)
					return
				}
				<-ctx.Done()
				got <- context.Cause(ctx)
			}))
		base, cancelDeadline := context.WithDeadline(context.WithValue(context.Background(), key{}, "v"), deadline)
		defer cancelDeadline()
		ctx, cancel := context.WithCancelCause(base)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://x/pay", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k-ctx")
		req.Header.Set("Authorization", "Bearer test-client")
		done := make(chan struct{})
		start := time.Now()
		go func() { defer close(done); h.ServeHTTP(httptest.NewRecorder(), req) }()
		synctest.Wait()
		cancel(errors.New("client went away"))
		require.ErrorIs(t, <-got, context.DeadlineExceeded, "only the deadline ends the handler")
		require.Equal(t, time.Hour, time.Since(start), "it ran until its deadline")
		<-done
	})
}

// WithShutdown ends the handlers of claimed requests, with the shutdown
// context's cause, when the server stops.
func TestWithShutdownCancelsTheHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		shutdown, stop := context.WithCancelCause(context.Background())
		stopping := errors.New("server shutting down")
		got := make(chan error, 1)
		h := idempotency.New(memstore.New(), idempotency.WithLogger(quiet), idempotency.WithShutdown(shutdown)).Wrap(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				<-r.Context().Done()
				got <- context.Cause(r.Context())
				w.WriteHeader(http.StatusServiceUnavailable)
			}))
		req := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k-shutdown")
		req.Header.Set("Authorization", "Bearer test-client")
		rec := httptest.NewRecorder()
		done := make(chan struct{})
		go func() { defer close(done); h.ServeHTTP(rec, req) }()
		synctest.Wait()
		select {
		case err := <-got:
			t.Fatalf("the handler ended before the shutdown: %v", err)
		default:
		}
		stop(stopping)
		require.ErrorIs(t, <-got, stopping)
		<-done
		require.Equal(t, http.StatusServiceUnavailable, rec.Code)
	})
}

// Without an Authorization header the default principal is "", so by
// default anonymous callers must not share one namespace: a
// second anonymous caller who sends the first one's key (event-derived keys
// are guessable) gets 401, never the first caller's stored response; only
// WithAnonymousKeys brings the shared scope back.
func TestAnonymousCallersDoNotShareKeys(t *testing.T) {
	h := &payments{}
	srv := serve(t, memstore.New(), h)
	first := post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization:")
	requireProblem(t, first, http.StatusUnauthorized, idempotency.CodePrincipalMissing)
	second := post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization:")
	requireProblem(t, second, http.StatusUnauthorized, idempotency.CodePrincipalMissing)
	require.Zero(t, h.n.Load(), "the handler ran for an anonymous guarded request")
	// An identified caller is served, and requests without a key are not
	// guarded.
	a := post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization: Bearer alice")
	require.Equal(t, http.StatusCreated, a.Status, a.Body)
	requireReplay(t, post(t, srv, "order-confirm-42", `{"amount":5}`, "Authorization: Bearer alice"), a)
	require.Equal(t, http.StatusCreated, post(t, srv, "", `{}`, "Authorization:").Status)
}

// failingComplete is a memory store whose Store.Complete fails.
type failingComplete struct{ *memstore.Store }

func (failingComplete) Complete(context.Context, idempotency.Lease, idempotency.Response, time.Time) error {
	return errStore
}

// A handler that never asked for its unit is completed with Store.Complete
// (no transaction), tried again for 10 s while it fails. If it fails all
// that time, the work was done all the same: its response is sent, and the
// record stays in progress until its lease expires (a retry meanwhile gets
// 409 in progress, never a second run).
func TestCompleteFailureWithoutAUnitSendsTheResponse(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := failingComplete{memstore.New()}
		h := &payments{}
		g := idempotency.New(store, idempotency.WithLogger(quiet), idempotency.WithAnonymousKeys(true)).Wrap(h)
		start := time.Now()
		a := send(t, g, "k", `{}`)
		require.Equal(t, 10*time.Second, time.Since(start), "the completion was tried for its bound")
		require.Equal(t, http.StatusCreated, a.Code)
		require.Contains(t, a.Body.String(), `"payment":1`)
		require.Equal(t, http.StatusConflict, send(t, g, "k", `{}`).Code)
		require.Equal(t, int64(1), h.n.Load(), "the handler ran once")
	})
}
