package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// serveOne serves one request through h in process and returns the answer.
func serveOne(h http.Handler, method, target, key, contentType, body string) answer {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	r.Header.Set("Authorization", "Bearer test-client")
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return answer{w.Code, w.Header(), w.Body.String()}
}

// A method sent in lower case (browsers' fetch() sends "patch" as written)
// is guarded as its upper-case name: the retry replays instead of running
// the handler again, and it shares the scope of the upper-case spelling.
func TestLowerCaseMethodIsGuarded(t *testing.T) {
	h := &payments{}
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
	first := serveOne(mw.Wrap(h), "patch", "/orders/1", "k", "application/json", `{"a":1}`)
	require.Equal(t, http.StatusCreated, first.Status)
	requireReplay(t, serveOne(mw.Wrap(h), "patch", "/orders/1", "k", "application/json", `{"a":1}`), first)
	requireReplay(t, serveOne(mw.Wrap(h), "PATCH", "/orders/1", "k", "application/json", `{"a":1}`), first)
	requireReplay(t, serveOne(mw.Wrap(h), "Patch", "/orders/1", "k", "application/json", `{"a":1}`), first)
	second := serveOne(mw.Wrap(h), "post", "/orders", "k2", "application/json", `{}`)
	requireReplay(t, serveOne(mw.Wrap(h), "post", "/orders", "k2", "application/json", `{}`), second)
	require.EqualValues(t, 2, h.n.Load(), "one execution per key")
}

// A first execution never carries Idempotent-Replayed, even when its
// handler copied it from another service's answer; only replays do.
func TestReplayMarkerNeverOnAFirstExecution(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Idempotent-Replayed", "true") // copied from an upstream's replayed answer
		w.Header()["idempotent-replayed"] = []string{"true"}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "ok")
	})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
	first := serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "", "x")
	require.Equal(t, http.StatusCreated, first.Status)
	for name := range first.Header {
		require.NotEqualf(t, "idempotent-replayed", strings.ToLower(name), "a first execution carries %s", name)
	}
	replay := serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "", "x")
	require.Equal(t, []string{"true"}, replay.Header.Values(idempotency.ReplayedHeader))
}

// Nor does a trailer carry it on a first execution: neither one set with
// http.TrailerPrefix after the body, nor one declared in a Trailer header.
func TestReplayMarkerNeverInAFirstExecutionsTrailers(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "Idempotent-Replayed, X-Checksum")
		w.Header().Add("Trailer", "idempotent-replayed")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "ok")
		w.Header().Set("Idempotent-Replayed", "true")
		w.Header().Set("X-Checksum", "c0ffee")
		w.Header().Set(http.TrailerPrefix+"Idempotent-Replayed", "true")
		w.Header().Set(http.TrailerPrefix+"idempotent-replayed", "true")
	})
	srv := serve(t, memstore.New(), h)
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader("x"))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer test-client")
	req.Header.Set("Idempotency-Key", "k-trailer")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "ok", string(body))
	for _, hdr := range []http.Header{resp.Header, resp.Trailer} {
		for name, v := range hdr {
			require.NotEqualf(t, "idempotent-replayed", strings.ToLower(name), "a first execution carries %s", name)
			if strings.EqualFold(name, "Trailer") {
				require.NotContains(t, strings.ToLower(strings.Join(v, ",")), "idempotent-replayed")
			}
		}
	}
	require.Equal(t, "c0ffee", resp.Trailer.Get("X-Checksum"), "other trailers go through")
}

// With the middleware mounted on a subtree (outer.Handle("/api/", ...)),
// r.Pattern is "/api/" for every inner route: the scope must come from the
// inner router's own pattern (or the path), or the same key on two inner
// routes would be refused as a reused key that a client never retries.
func TestMountedRouterRoutesAreSeparateScopes(t *testing.T) {
	var payments, refunds atomic.Int64
	inner := http.NewServeMux()
	inner.HandleFunc("POST /api/payments", func(w http.ResponseWriter, r *http.Request) {
		payments.Add(1)
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "payment")
	})
	inner.HandleFunc("POST /api/refunds/{id}", func(w http.ResponseWriter, r *http.Request) {
		refunds.Add(1)
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "refund "+r.PathValue("id"))
	})
	var routes []string
	obs := idempotency.WithObserver(idempotency.Observer{Claimed: func(_ context.Context, e idempotency.Event) {
		routes = append(routes, e.Scope.Route)
	}})
	outer := http.NewServeMux()
	outer.Handle("/api/", idempotency.New(memstore.New(), idempotency.WithLogger(quiet), obs).Wrap(inner))

	p := serveOne(outer, http.MethodPost, "/api/payments", "k", "application/json", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, p.Status, p.Body)
	r := serveOne(outer, http.MethodPost, "/api/refunds/7", "k", "application/json", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.Status, r.Body)
	require.Equal(t, "refund 7", r.Body)
	requireReplay(t, serveOne(outer, http.MethodPost, "/api/payments", "k", "application/json", `{"amount":5}`), p)
	requireReplay(t, serveOne(outer, http.MethodPost, "/api/refunds/7", "k", "application/json", `{"amount":5}`), r)
	require.EqualValues(t, 1, payments.Load())
	require.EqualValues(t, 1, refunds.Load())
	require.Equal(t, []string{"POST /api/payments", "POST /api/refunds/{id}"}, routes, "the inner patterns")

	// Behind a subtree with another router (not a ServeMux), the path
	// names the route.
	var runs atomic.Int64
	other := http.NewServeMux()
	other.Handle("/v2/", idempotency.New(memstore.New(), idempotency.WithLogger(quiet)).Wrap(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})))
	require.Equal(t, http.StatusCreated, serveOne(other, http.MethodPost, "/v2/payments", "k", "", "").Status)
	require.Equal(t, http.StatusCreated, serveOne(other, http.MethodPost, "/v2/refunds", "k", "", "").Status)
	require.EqualValues(t, 2, runs.Load())
}

// The same multipart bytes under another boundary are another body
// (boundary=X says amount=1, boundary=Y says amount=1000): the second
// request is a reused key, never the first one's replay.
func TestContentTypeParametersAreFingerprinted(t *testing.T) {
	// Under boundary=X the body is one part, amount=1; under boundary=Y
	// the first part, amount=1000, is another.
	body := "--Y\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n1000\r\n--Y--\r\n" +
		"--X\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n1\r\n--X--\r\n"
	h := &payments{}
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
	first := serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "multipart/form-data; boundary=X", body)
	require.Equal(t, http.StatusCreated, first.Status)
	requireProblem(t, serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "multipart/form-data; boundary=Y", body),
		http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	requireProblem(t, serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "multipart/form-data; boundary=X; charset=latin1", body),
		http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	requireReplay(t, serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", `multipart/form-data; boundary="X"`, body), first)
	require.EqualValues(t, 1, h.n.Load())
}

// JSON member names that differ only in case are one field to
// encoding/json, the last one winning: {"amount":1,"AMOUNT":1000} means
// 1000 and its reordering 1. The second is a reused key, never the first
// one's replay.
func TestJSONNamesEqualUnderCaseFoldingAreFingerprintedRaw(t *testing.T) {
	h := &payments{}
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet))
	first := serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "application/json", `{"amount":1,"AMOUNT":1000}`)
	require.Equal(t, http.StatusCreated, first.Status)
	requireProblem(t, serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "application/json", `{"AMOUNT":1000,"amount":1}`),
		http.StatusUnprocessableEntity, idempotency.CodeKeyReused)
	requireReplay(t, serveOne(mw.Wrap(h), http.MethodPost, "/payments", "k", "application/json", `{"amount":1,"AMOUNT":1000}`), first)
	require.EqualValues(t, 1, h.n.Load())
}

// Records written under fingerprint version 1 (which dropped content-type
// parameters) are still compared in version 1: a completed one is
// replayed, an abandoned one is taken over and keeps its version.
func TestFingerprintVersion1RecordsStillMatch(t *testing.T) {
	store := memstore.New()
	const body = `{"amount":5}`
	// The version 1 fingerprint of POST /payments with this body, golden:
	// computed by the implementation that wrote version 1 records.
	const v1 = "b377d58c8f13a23aabedfeb76f90ce251541cac99a6ac63f66b3573e95edbb96"
	principal := "acct-1"
	claim := func(key string) idempotency.Record {
		res, err := store.Claim(t.Context(), idempotency.Claim{
			Scope:       idempotency.Scope{Principal: principal, Method: "POST", Route: "POST /payments", Key: key},
			Fingerprint: v1, FingerprintVersion: 1, Owner: "old-server", Now: time.Now().Add(-time.Hour), LeaseFor: time.Second,
			ReplayWindow: 24 * time.Hour,
		})
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, res.Outcome)
		return res.Record
	}
	done := claim("done")
	require.NoError(t, store.Complete(t.Context(), done.Lease(), idempotency.Response{Status: 201, Body: []byte("old")}, time.Now()))
	claim("abandoned")

	h := &payments{}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idempotency.New(store, idempotency.WithLogger(quiet),
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return principal, nil })).Wrap(h))
	a := serveOne(mux, http.MethodPost, "/payments", "done", "application/json; charset=utf-8", body)
	require.Equal(t, http.StatusCreated, a.Status)
	require.Equal(t, "old", a.Body)
	require.Equal(t, "true", a.Header.Get(idempotency.ReplayedHeader))
	requireProblem(t, serveOne(mux, http.MethodPost, "/payments", "done", "application/json", `{"amount":6}`),
		http.StatusUnprocessableEntity, idempotency.CodeKeyReused)

	b := serveOne(mux, http.MethodPost, "/payments", "abandoned", "application/json; charset=utf-8", body)
	require.Equal(t, http.StatusCreated, b.Status, b.Body)
	rec, err := store.Get(t.Context(), idempotency.Scope{Principal: principal, Method: "POST", Route: "POST /payments", Key: "abandoned"})
	require.NoError(t, err)
	require.Equal(t, idempotency.Completed, rec.State)
	require.EqualValues(t, 2, rec.Generation, "taken over")
	require.Equal(t, 1, rec.FingerprintVersion, "a takeover keeps the record's version")
	require.EqualValues(t, 1, h.n.Load())
}

// A full memory store answers a new key 503 idempotency_store_full with
// Retry-After: 1, not as a store outage; its log says "full" at Warn, at
// most once a second however many keys it refuses, with the count of those
// it left out. It keeps replaying what it holds, and takes new keys again
// once its records are past their window, with no Reaper.
func TestFullStoreAnswersStoreFull(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		log, buf := bufLogger()
		var runs atomic.Int32
		refused := map[idempotency.Code]int{}
		mw := idempotency.New(memstore.New(memstore.WithMaxRecords(2)), idempotency.WithLogger(log),
			idempotency.WithObserver(idempotency.Observer{Refused: func(_ context.Context, e idempotency.Event) { refused[e.Code]++ }}))
		h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"run":`+strconv.Itoa(int(runs.Load()))+`}`)
		}))
		post := func(key string) answer {
			return serveOne(h, http.MethodPost, "/payments", key, "application/json", `{}`)
		}
		a := post("a")
		require.Equal(t, http.StatusCreated, a.Status)
		require.Equal(t, http.StatusCreated, post("b").Status)

		for i := range 50 {
			full := post("new-" + strconv.Itoa(i))
			requireProblem(t, full, http.StatusServiceUnavailable, idempotency.CodeStoreFull)
			require.Equal(t, "1", full.Header.Get("Retry-After"))
		}
		require.Equal(t, map[idempotency.Code]int{idempotency.CodeStoreFull: 50}, refused)
		require.EqualValues(t, 2, runs.Load(), "the handler did not run for the refused keys")
		requireReplay(t, post("a"), a)
		out := buf.String()
		require.Equal(t, 1, strings.Count(out, `msg="idempotency: store full`), "one record for 50 refusals:\n%s", out)
		require.Contains(t, out, "level=WARN")
		require.NotContains(t, out, "unavailable")
		require.NotContains(t, out, "level=ERROR")

		time.Sleep(time.Second)
		requireProblem(t, post("after-a-second"), http.StatusServiceUnavailable, idempotency.CodeStoreFull)
		require.Equal(t, 2, strings.Count(buf.String(), `msg="idempotency: store full`))
		require.Contains(t, buf.String(), "refused_since_last_record=49")

		time.Sleep(24 * time.Hour) // a and b are past their window
		c := post("c")
		require.Equal(t, http.StatusCreated, c.Status)
		requireFresh(t, c)
		a2 := post("a")
		requireFresh(t, a2)
		require.Equal(t, `{"run":4}`, a2.Body, "past its window a key is a new request")
	})
}

// A request whose record could never fit in the store is a 413, not a 503
// to retry forever; smaller ones still run.
func TestRecordTooLargeForTheStoreIs413(t *testing.T) {
	var runs atomic.Int32
	h := idempotency.New(memstore.New(memstore.WithMaxBytes(4096)), idempotency.WithLogger(quiet)).Wrap(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		}))
	requireProblem(t, serveOne(h, http.MethodPost, "/payments", "big", "application/json", `{"note":"`+strings.Repeat("x", 8000)+`"}`),
		http.StatusRequestEntityTooLarge, idempotency.CodeRequestTooLarge)
	require.Equal(t, http.StatusCreated, serveOne(h, http.MethodPost, "/payments", "small", "application/json", `{}`).Status)
	require.Equal(t, int32(1), runs.Load())
}
