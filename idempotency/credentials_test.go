package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

func xAccount(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil }

// A request resumed by the Completer carries no credentials, so a handler
// behind an auth layer answers it 401 (or 403). That refusal is the
// resume's, not the client's: it is never stored. The record stays in
// progress, its lease ended, the Completer reports it (Observer, Warn log,
// CompleterReport.NeedCredentials) and backs off, and the client's retry,
// with its credentials, takes it over and resumes after the committed
// phase: one order, one charge, a 201 that is no replay.
func TestCompleterNeverStoresARefusalOfTheResume(t *testing.T) {
	for _, status := range []int{http.StatusUnauthorized, http.StatusForbidden} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := memstore.New()
				s := newShop()
				sc := shopScope
				sc.Principal = "acct-1"
				crashed(t, mem, sc, "/payments", `{"amount":4200}`, time.Now(),
					idempotency.CommittedPhase{Name: "order", Output: []byte("ord_1")})
				refuse := func(next http.Handler) http.Handler {
					return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						if r.Header.Get("X-Account") == "" {
							http.Error(w, "no credentials", status)
							return
						}
						next.ServeHTTP(w, r)
					})
				}
				log, buf := bufLogger()
				obs := &seen{}
				mw := idempotency.New(mem, idempotency.WithPrincipal(xAccount), idempotency.WithLogger(log),
					idempotency.WithObserver(obs.observer()))
				c := mw.Completer(map[string]http.Handler{"POST /payments": refuse(s)})

				time.Sleep(31 * time.Second)
				rep, err := c.RunOnce(t.Context())
				require.NoError(t, err)
				require.Equal(t, idempotency.CompleterReport{Found: 1, NeedCredentials: 1}, rep)
				_, by := obs.take()
				require.Len(t, by["executed"], 1)
				require.Equal(t, idempotency.OutcomeNeedsCredentials, by["executed"][0].Outcome)
				require.Equal(t, status, by["executed"][0].Status)
				require.Contains(t, buf.String(), `level=WARN msg="idempotency completer: the resumed request was `+
					`refused for want of credentials`)
				require.NotContains(t, buf.String(), "completed an abandoned request")
				rec, err := mem.Get(t.Context(), sc)
				require.NoError(t, err)
				require.Equal(t, idempotency.InProgress, rec.State, "the refusal is not stored")
				require.Equal(t, "order", rec.RecoveryPoint)
				require.False(t, rec.LeaseUntil.After(time.Now()), "its lease ended, for the client's retry")

				time.Sleep(time.Second)
				again, err := c.RunOnce(t.Context())
				require.NoError(t, err)
				require.Equal(t, idempotency.CompleterReport{Found: 1, Skipped: 1}, again, "it backs off")
				require.Equal(t, 1, idempotency.CompleterBackoffs(c))

				mux := http.NewServeMux()
				mux.Handle("POST /payments", mw.Wrap(refuse(s)))
				req := newPost(`{"amount":4200}`, "order-42")
				req.Header.Set("X-Account", "acct-1")
				a := record(mux, req)
				require.Equal(t, http.StatusCreated, a.Code, a.Body.String())
				require.Empty(t, a.Header().Get(idempotency.ReplayedHeader), "the first answer is no replay")
				require.Zero(t, s.runs.Load(), "the order phase was not run again")
				calls, _ := s.proc.counts()
				require.Equal(t, map[string]int{idempotency.DownstreamKeyOf(sc, "charge"): 1}, calls)
				rec, err = mem.Get(t.Context(), sc)
				require.NoError(t, err)
				require.Equal(t, idempotency.Completed, rec.State)
				require.Equal(t, http.StatusCreated, rec.Response.Status)
			})
		})
	}
}

// The principal is taken from the library, live and on resume alike:
// Run.Scope.Principal holds what WithPrincipal's function returned, and a
// resumed request carries no credential header.
func TestThePrincipalReachesTheHandlerLiveAndOnResume(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var principals, auth []string
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			principals = append(principals, run.Scope.Principal)
			auth = append(auth, r.Header.Get("X-Account"))
			if run.Scope.Key == "crash" && len(principals) == 1 {
				_, err := run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return nil, nil })
				require.NoError(t, err)
				panic(http.ErrAbortHandler) // kept at its recovery point, as a crash leaves it
			}
			w.WriteHeader(http.StatusCreated)
		})
		mw := idempotency.New(mem, idempotency.WithPrincipal(xAccount), idempotency.WithLogger(quiet))
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(h))
		req := newPost(`{}`, "crash")
		req.Header.Set("X-Account", "acct-7")
		func() {
			defer func() { require.Equal(t, http.ErrAbortHandler, recover()) }()
			record(mux, req)
		}()
		time.Sleep(time.Second)
		rep, err := mw.Completer(map[string]http.Handler{"POST /payments": h}).RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Completed)
		require.Equal(t, []string{"acct-7", "acct-7"}, principals)
		require.Equal(t, []string{"acct-7", ""}, auth, "a resume carries no credentials")
	})
}

// newPost returns a guarded POST /payments with key and body.
func newPost(body, key string) *http.Request {
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	return req
}

// record serves req through h in process and returns the answer.
func record(h http.Handler, req *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}
