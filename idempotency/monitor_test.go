package idempotency_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

var (
	monitorSecret = bytes.Repeat([]byte("0123456789abcdef"), 2)
	newSecret     = bytes.Repeat([]byte("fedcba9876543210"), 2)
)

// accountPrincipal is the principal of the monitor tests: the X-Account
// header, as an authentication layer would set it.
func accountPrincipal(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil }

// monitored serves h as "POST /payments" and "PATCH /payments/{id}" on a
// mux, with the middleware's Monitor at "GET /operations/", and returns
// the mux and the number of times h ran to its end.
func monitored(t *testing.T, store idempotency.Store, h http.Handler,
	opts ...idempotency.Option) (*http.ServeMux, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r)
		runs.Add(1)
	})
	opts = append([]idempotency.Option{idempotency.WithLogger(quiet),
		idempotency.WithPrincipal(accountPrincipal),
		idempotency.WithMonitor("/operations/", monitorSecret)}, opts...)
	mw := idempotency.New(store, opts...)
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(counted))
	mux.Handle("PATCH /payments/{id}", mw.Wrap(counted))
	mux.Handle("/operations/", mw.Monitor(mux))
	return mux, &runs
}

// exchange serves one request through h in process: method and target,
// the account ("" sends none), and extra header lines "Name: value".
func exchange(h http.Handler, method, target, account, body string, extra ...string) answer {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req := httptest.NewRequest(method, target, rd)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if account != "" {
		req.Header.Set("X-Account", account)
	}
	for _, e := range extra {
		name, value, _ := strings.Cut(e, ":")
		req.Header.Add(name, strings.TrimSpace(value))
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return answer{rec.Code, rec.Header(), rec.Body.String()}
}

func pay(h http.Handler, account, key string) answer {
	return exchange(h, http.MethodPost, "/payments", account, `{"amount":4200}`,
		"Idempotency-Key: "+key)
}

func lookup(h http.Handler, account, key, target string) answer {
	return exchange(h, http.MethodGet, "/operations/", account, "", "Idempotency-Key: "+key,
		"Idempotency-Lookup: "+target)
}

type status struct {
	Status  string `json:"status"`
	AgeMS   int64  `json:"age_ms"`
	Monitor string `json:"monitor"`
}

// requireInProgress checks an answer that says the operation runs: 202,
// Retry-After, the status body; it returns the body.
func requireInProgress(t *testing.T, a answer) status {
	t.Helper()
	require.Equal(t, http.StatusAccepted, a.Status, a.Body)
	require.Equal(t, "1", a.Header.Get("Retry-After"))
	require.Equal(t, "application/json", a.Header.Get("Content-Type"))
	require.Equal(t, "no-store", a.Header.Get("Cache-Control"))
	require.Empty(t, a.Header.Get(idempotency.ReplayedHeader))
	var s status
	require.NoError(t, json.Unmarshal([]byte(a.Body), &s), a.Body)
	require.Equal(t, "in_progress", s.Status)
	return s
}

// slowCharge is a handler that takes d, then answers 201 with a charge.
func slowCharge(d time.Duration) http.Handler {
	var n atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(d)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "max-age=3600")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"charge":"ch_`+string(rune('0'+n.Add(1)))+`"}`)
	})
}

// A charge that takes 5 s answers 202 after WithAcceptAfter's second, with
// its monitor in Location; the monitor says in progress, with the age;
// a retry gets the in-progress 409 with the same Location; once the charge
// is done the monitor answers its 201, byte for byte as the replay does.
func TestAcceptAfterAnswers202AndTheMonitorTheResponse(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mux, runs := monitored(t, memstore.New(), slowCharge(5*time.Second),
			idempotency.WithAcceptAfter(time.Second))
		start := time.Now()
		a := pay(mux, "acct_1", "order-42")
		require.Equal(t, time.Second, time.Since(start), "answered after WithAcceptAfter")
		st := requireInProgress(t, a)
		loc := a.Header.Get("Location")
		require.True(t, strings.HasPrefix(loc, "/operations/"), loc)
		require.Equal(t, loc, a.Header.Get("Operation-Location"))
		require.Equal(t, loc, st.Monitor)
		require.Equal(t, int64(1000), st.AgeMS)
		require.NotContains(t, loc, "order-42")
		require.NotContains(t, loc, url.PathEscape("order-42"))

		time.Sleep(time.Second)
		st = requireInProgress(t, exchange(mux, http.MethodGet, loc, "acct_1", ""))
		require.Equal(t, int64(2000), st.AgeMS)
		retry := pay(mux, "acct_1", "order-42")
		requireProblem(t, retry, http.StatusConflict, idempotency.CodeInProgress)
		require.Equal(t, loc, retry.Header.Get("Location"), "the 409 points to the same monitor")
		again := lookup(mux, "acct_1", "order-42", "POST /payments")
		requireInProgress(t, again)
		require.Equal(t, loc, again.Header.Get("Location"), "one operation, one identifier")

		time.Sleep(4 * time.Second)
		synctest.Wait()
		done := exchange(mux, http.MethodGet, loc, "acct_1", "")
		require.Equal(t, http.StatusCreated, done.Status, done.Body)
		require.Equal(t, `{"charge":"ch_1"}`, done.Body)
		require.Equal(t, "true", done.Header.Get(idempotency.ReplayedHeader))
		require.Equal(t, "no-store", done.Header.Get("Cache-Control"),
			"a monitor's answer is per principal: no cache keeps it")
		replay := pay(mux, "acct_1", "order-42")
		requireReplay(t, replay, done)
		require.Equal(t, "max-age=3600", replay.Header.Get("Cache-Control"))
		head := exchange(mux, http.MethodHead, loc, "acct_1", "")
		require.Equal(t, http.StatusCreated, head.Status)
		require.Equal(t, int64(1), runs.Load(), "charged once")
	})
}

// A handler that answers within WithAcceptAfter answers as without it.
func TestAcceptAfterQuickHandlerAnswersItself(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mux, _ := monitored(t, memstore.New(), slowCharge(100*time.Millisecond),
			idempotency.WithAcceptAfter(time.Second))
		start := time.Now()
		a := pay(mux, "acct_1", "k")
		require.Equal(t, 100*time.Millisecond, time.Since(start))
		require.Equal(t, http.StatusCreated, a.Status)
		require.Equal(t, "max-age=3600", a.Header.Get("Cache-Control"))
		requireFresh(t, a)
	})
}

// A client that goes away before WithAcceptAfter gets nothing; the handler
// runs to its end, and the monitor then gives its response.
func TestAcceptAfterClientGoneHandlerRunsOn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mux, runs := monitored(t, memstore.New(), slowCharge(5*time.Second),
			idempotency.WithAcceptAfter(time.Minute))
		ctx, cancel := context.WithCancel(t.Context())
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/payments",
			strings.NewReader(`{"amount":4200}`))
		req.Header.Set("X-Account", "acct_1")
		req.Header.Set("Idempotency-Key", "gone")
		rec := httptest.NewRecorder()
		go func() { time.Sleep(time.Second); cancel() }()
		mux.ServeHTTP(rec, req)
		require.False(t, rec.Flushed)
		require.Zero(t, rec.Body.Len(), "nobody to answer")
		time.Sleep(5 * time.Second)
		synctest.Wait()
		require.Equal(t, int64(1), runs.Load())
		done := lookup(mux, "acct_1", "gone", "POST /payments")
		require.Equal(t, http.StatusCreated, done.Status, done.Body)
		require.Equal(t, "true", done.Header.Get(idempotency.ReplayedHeader))
	})
}

// A handler that panics after its 202 is reported (OutcomePanicked), its
// key given up, and the process goes on; one that panics before it
// panics through ServeHTTP as without WithAcceptAfter.
func TestAcceptAfterPanics(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var outcomes []idempotency.Outcome
		obs := idempotency.Observer{Executed: func(_ context.Context, e idempotency.Event) {
			outcomes = append(outcomes, e.Outcome)
		}}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			d, _ := time.ParseDuration(r.URL.Query().Get("after"))
			time.Sleep(d)
			panic("boom")
		})
		mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet),
			idempotency.WithPrincipal(accountPrincipal), idempotency.WithObserver(obs),
			idempotency.WithMonitor("/operations/", monitorSecret),
			idempotency.WithAcceptAfter(time.Second))
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(h))
		mux.Handle("/operations/", mw.Monitor(mux))

		a := exchange(mux, http.MethodPost, "/payments?after=2s", "acct_1", `{}`,
			"Idempotency-Key: late")
		requireInProgress(t, a)
		time.Sleep(2 * time.Second)
		synctest.Wait()
		require.Equal(t, []idempotency.Outcome{idempotency.OutcomePanicked}, outcomes)
		gone := exchange(mux, http.MethodGet, a.Header.Get("Location"), "acct_1", "")
		requireProblem(t, gone, http.StatusNotFound, idempotency.CodeRequestAbsent)

		require.PanicsWithValue(t, "boom", func() {
			exchange(mux, http.MethodPost, "/payments?after=10ms", "acct_1", `{}`,
				"Idempotency-Key: early")
		})
	})
}

// The monitor and the lookup answer one principal only: another principal,
// a guessed identifier, one altered by a byte, and a key sent in the URL
// all get the same 404, which tells nothing of the operation; the key is
// never read from the URL; a caller without a principal gets 401.
func TestMonitorPrincipalIsolation(t *testing.T) {
	mux, _ := monitored(t, memstore.New(), slowCharge(0))
	first := pay(mux, "acct_1", "order-42")
	require.Equal(t, http.StatusCreated, first.Status)
	// An identifier of the completed request: as a 409 would carry it.
	in := lookup(mux, "acct_1", "order-42", "POST /payments")
	requireReplay(t, in, first)

	// The identifier comes from an in-progress 409.
	release, started := make(chan struct{}), make(chan struct{})
	mux2, _ := monitored(t, memstore.New(), http.HandlerFunc(func(w http.ResponseWriter,
		r *http.Request) {
		close(started)
		<-release
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "created")
	}))
	done := make(chan answer)
	go func() { done <- pay(mux2, "acct_1", "order-42") }()
	<-started
	conflict := pay(mux2, "acct_1", "order-42")
	requireProblem(t, conflict, http.StatusConflict, idempotency.CodeInProgress)
	loc := conflict.Header.Get("Location")
	require.NotEmpty(t, loc)
	close(release)
	require.Equal(t, http.StatusCreated, (<-done).Status)
	mine := exchange(mux2, http.MethodGet, loc, "acct_1", "")
	require.Equal(t, http.StatusCreated, mine.Status)
	require.Equal(t, "created", mine.Body)

	absent := func(a answer) {
		t.Helper()
		p := requireProblem(t, a, http.StatusNotFound, idempotency.CodeRequestAbsent)
		require.Empty(t, p.Detail)
		require.Empty(t, a.Header.Get("Location"))
	}
	id := loc[strings.LastIndexByte(loc, '/')+1:]
	altered := []byte(id)
	altered[len(altered)/2] ^= 1
	if altered[len(altered)/2] == '/' {
		altered[len(altered)/2] = 'A'
	}
	nothing := lookup(mux2, "acct_1", "never-sent", "POST /payments")
	absent(nothing)
	for name, a := range map[string]answer{
		"another principal":           exchange(mux2, http.MethodGet, loc, "acct_2", ""),
		"a guessed identifier":        exchange(mux2, http.MethodGet, "/operations/AQIDBAUGBwgJCgsMDQ4PEBESExQ", "acct_1", ""),
		"an altered identifier":       exchange(mux2, http.MethodGet, "/operations/"+string(altered), "acct_1", ""),
		"the key as the identifier":   exchange(mux2, http.MethodGet, "/operations/order-42", "acct_1", ""),
		"another principal's lookup":  lookup(mux2, "acct_2", "order-42", "POST /payments"),
		"another server's identifier": exchange(mux2, http.MethodGet, strings.Replace(loc, id, sealedElsewhere(t), 1), "acct_1", ""),
	} {
		t.Run(name, func(t *testing.T) {
			absent(a)
			require.Equal(t, nothing.Body, a.Body, "the same answer as for a key never sent")
		})
	}
	// A key in the URL is never read as a key.
	inURL := exchange(mux2, http.MethodGet, "/operations/?Idempotency-Key=order-42", "acct_1", "",
		"Idempotency-Lookup: POST /payments")
	requireProblem(t, inURL, http.StatusBadRequest, idempotency.CodeKeyMissing)
	requireProblem(t, exchange(mux2, http.MethodGet, loc, "", ""), http.StatusUnauthorized,
		idempotency.CodePrincipalMissing)
	requireProblem(t, lookup(mux2, "", "order-42", "POST /payments"), http.StatusUnauthorized,
		idempotency.CodePrincipalMissing)
}

// sealedElsewhere returns the identifier another server (another secret)
// gives the same request of the same principal.
func sealedElsewhere(t *testing.T) string {
	t.Helper()
	release, started := make(chan struct{}), make(chan struct{})
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(quiet),
		idempotency.WithPrincipal(accountPrincipal),
		idempotency.WithMonitor("/operations/", newSecret))
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
	}))
	done := make(chan answer)
	go func() { done <- pay(h, "acct_1", "order-42") }()
	<-started
	loc := pay(h, "acct_1", "order-42").Header.Get("Location")
	close(release)
	<-done
	require.NotEmpty(t, loc)
	return loc[strings.LastIndexByte(loc, '/')+1:]
}

// The lookup by key: absent, in progress (with the operation's monitor),
// completed (the replay), absent again past the replay window; routes
// named by the mux's pattern; and its refusals.
func TestLookup(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mux, runs := monitored(t, memstore.New(), slowCharge(3*time.Second),
			idempotency.WithReplayWindow(time.Hour))
		requireProblem(t, lookup(mux, "acct_1", "k", "POST /payments"), http.StatusNotFound,
			idempotency.CodeRequestAbsent)
		done := make(chan answer)
		go func() { done <- pay(mux, "acct_1", "k") }()
		time.Sleep(time.Second)
		in := lookup(mux, "acct_1", "k", "POST /payments")
		st := requireInProgress(t, in)
		require.Equal(t, int64(1000), st.AgeMS)
		require.Equal(t, in.Header.Get("Location"), st.Monitor)
		first := <-done
		requireReplay(t, lookup(mux, "acct_1", "k", "post /payments"), first)
		// As an sf-string, as keys may be sent.
		requireReplay(t, exchange(mux, http.MethodGet, "/operations/", "acct_1", "",
			`Idempotency-Key: "k"`, "Idempotency-Lookup: POST /payments"), first)

		// The pattern route: the lookup names "PATCH /payments/{id}".
		patch := exchange(mux, http.MethodPatch, "/payments/7", "acct_1", `{"a":1}`,
			"Idempotency-Key: p")
		requireReplay(t, lookup(mux, "acct_1", "p", "PATCH /payments/7"), patch)
		// The scope is the route's: another path of it names the same record
		// (the path is in the fingerprint, which a lookup cannot check).
		requireReplay(t, lookup(mux, "acct_1", "p", "PATCH /payments/8?x=1"), patch)

		time.Sleep(time.Hour + time.Second)
		requireProblem(t, lookup(mux, "acct_1", "k", "POST /payments"), http.StatusNotFound,
			idempotency.CodeRequestAbsent)
		require.Equal(t, int64(2), runs.Load(), "no lookup ran a handler")

		for name, a := range map[string]answer{
			"no lookup header": exchange(mux, http.MethodGet, "/operations/", "acct_1", "",
				"Idempotency-Key: k"),
			"two lookup headers": exchange(mux, http.MethodGet, "/operations/", "acct_1", "",
				"Idempotency-Key: k", "Idempotency-Lookup: POST /payments",
				"Idempotency-Lookup: POST /payments"),
			"a method not guarded": lookup(mux, "acct_1", "k", "GET /payments"),
			"no target":            lookup(mux, "acct_1", "k", "POST"),
			"an absolute URL":      lookup(mux, "acct_1", "k", "POST http://x/payments"),
			"no route":             lookup(mux, "acct_1", "k", "POST /refunds"),
		} {
			p := requireProblem(t, a, http.StatusBadRequest, idempotency.CodeLookupInvalid)
			require.NotEmpty(t, p.Detail, name)
		}
		requireProblem(t, exchange(mux, http.MethodGet, "/operations/", "acct_1", "",
			"Idempotency-Key: a\tb", "Idempotency-Lookup: POST /payments"),
			http.StatusBadRequest, idempotency.CodeKeyInvalid)
		post := exchange(mux, http.MethodPost, "/operations/", "acct_1", "")
		requireProblem(t, post, http.StatusMethodNotAllowed, idempotency.CodeLookupInvalid)
		require.Equal(t, "GET, HEAD", post.Header.Get("Allow"))
	})
}

// A request left in progress by a crash shows on the monitor as in
// progress until the Completer finishes it, then as completed.
func TestMonitorShowsTheCompleterFinishing(t *testing.T) {
	mem := memstore.New()
	sc := idempotency.Scope{Principal: "acct_1", Method: "POST", Route: "POST /payments",
		Key: "order-9"}
	crashed(t, mem, sc, "/payments", `{"amount":4200}`, time.Now().Add(-time.Minute))
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "charged by the completer")
	})
	mw := idempotency.New(mem, idempotency.WithLogger(quiet),
		idempotency.WithPrincipal(accountPrincipal),
		idempotency.WithMonitor("/operations/", monitorSecret))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(handler))
	mux.Handle("/operations/", mw.Monitor(mux))

	in := lookup(mux, "acct_1", "order-9", "POST /payments")
	requireInProgress(t, in)
	loc := in.Header.Get("Location")
	requireInProgress(t, exchange(mux, http.MethodGet, loc, "acct_1", ""))

	rep, err := mw.Completer(map[string]http.Handler{"POST /payments": handler}).RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Completed)
	done := exchange(mux, http.MethodGet, loc, "acct_1", "")
	require.Equal(t, http.StatusCreated, done.Status)
	require.Equal(t, "charged by the completer", done.Body)
	require.Equal(t, "true", done.Header.Get(idempotency.ReplayedHeader))
}

// A key used again past the replay window by another request is another
// operation: the first one's identifier does not show it.
func TestMonitorIdentifierNamesOneRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			<-release
			body, _ := io.ReadAll(r.Body)
			w.Write(body)
		})
		mux, _ := monitored(t, memstore.New(), h, idempotency.WithReplayWindow(time.Minute))
		go exchange(mux, http.MethodPost, "/payments", "acct_1", `{"a":1}`, "Idempotency-Key: k")
		synctest.Wait()
		loc := exchange(mux, http.MethodPost, "/payments", "acct_1", `{"a":1}`,
			"Idempotency-Key: k").Header.Get("Location")
		require.NotEmpty(t, loc)
		release <- struct{}{}
		synctest.Wait()
		require.Equal(t, `{"a":1}`, exchange(mux, http.MethodGet, loc, "acct_1", "").Body)

		time.Sleep(2 * time.Minute)
		go exchange(mux, http.MethodPost, "/payments", "acct_1", `{"a":2}`, "Idempotency-Key: k")
		synctest.Wait()
		requireProblem(t, exchange(mux, http.MethodGet, loc, "acct_1", ""), http.StatusNotFound,
			idempotency.CodeRequestAbsent)
		release <- struct{}{}
		synctest.Wait()
		requireProblem(t, exchange(mux, http.MethodGet, loc, "acct_1", ""), http.StatusNotFound,
			idempotency.CodeRequestAbsent)
		require.Equal(t, `{"a":2}`, lookup(mux, "acct_1", "k", "POST /payments").Body)
	})
}

// Rotating the secret: identifiers sealed with the old one open while it
// is among the previous secrets, and answer 404 once it is gone.
func TestMonitorSecretRotation(t *testing.T) {
	mem := memstore.New()
	release, started := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
	})
	server := func(secret []byte, previous ...[]byte) http.Handler {
		mw := idempotency.New(mem, idempotency.WithLogger(quiet),
			idempotency.WithPrincipal(accountPrincipal),
			idempotency.WithMonitor("https://api.example.com/operations", secret, previous...))
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(h))
		mux.Handle("/operations/", mw.Monitor(mux))
		return mux
	}
	old := server(monitorSecret)
	go pay(old, "acct_1", "k")
	<-started
	loc := pay(old, "acct_1", "k").Header.Get("Location")
	require.True(t, strings.HasPrefix(loc, "https://api.example.com/operations/"), loc)
	path := strings.TrimPrefix(loc, "https://api.example.com")

	step1 := server(monitorSecret, newSecret) // opens new, seals old
	step2 := server(newSecret, monitorSecret) // seals new, opens old
	step3 := server(newSecret)
	requireInProgress(t, exchange(step1, http.MethodGet, path, "acct_1", ""))
	requireInProgress(t, exchange(step2, http.MethodGet, path, "acct_1", ""))
	requireProblem(t, exchange(step3, http.MethodGet, path, "acct_1", ""), http.StatusNotFound,
		idempotency.CodeRequestAbsent)
	sealedNew := pay(step2, "acct_1", "k").Header.Get("Location")
	require.NotEqual(t, loc, sealedNew)
	requireInProgress(t, exchange(step1, http.MethodGet,
		strings.TrimPrefix(sealedNew, "https://api.example.com"), "acct_1", ""))
	close(release)
}

// Without WithMonitor the in-progress 409 has no Location, no request
// answers 202, and the Monitor answers lookups only; a WithMonitor that
// cannot be honoured is logged at Error and leaves the monitor off.
func TestMonitorOff(t *testing.T) {
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	for name, opt := range map[string]idempotency.Option{
		"no WithMonitor":  nil,
		"a short secret":  idempotency.WithMonitor("/operations/", []byte("short")),
		"no path":         idempotency.WithMonitor("", monitorSecret),
		"a short old one": idempotency.WithMonitor("/operations/", monitorSecret, []byte("x")),
	} {
		t.Run(name, func(t *testing.T) {
			logs.Reset()
			release, started := make(chan struct{}), make(chan struct{})
			mw := idempotency.New(memstore.New(), idempotency.WithLogger(logger),
				idempotency.WithPrincipal(accountPrincipal), opt,
				idempotency.WithAcceptAfter(time.Millisecond))
			mux := http.NewServeMux()
			mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter,
				r *http.Request) {
				close(started)
				<-release
				w.WriteHeader(http.StatusCreated)
			})))
			mux.Handle("/operations/", mw.Monitor(mux))
			done := make(chan answer)
			go func() { done <- pay(mux, "acct_1", "k") }()
			<-started
			a := pay(mux, "acct_1", "k")
			requireProblem(t, a, http.StatusConflict, idempotency.CodeInProgress)
			require.Empty(t, a.Header.Get("Location"))
			in := lookup(mux, "acct_1", "k", "POST /payments")
			requireInProgress(t, in)
			require.Empty(t, in.Header.Get("Location"))
			close(release)
			require.Equal(t, http.StatusCreated, (<-done).Status, "no 202 without a monitor")
			if opt != nil {
				require.Contains(t, logs.String(), "level=ERROR")
				require.Contains(t, logs.String(), "the monitor is off")
			}
		})
	}
}
