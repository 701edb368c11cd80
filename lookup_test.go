package saferetry

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// lossy is a base transport between the client and the server that
// loses, while lose is set, every POST: after forwarding it (the server
// acts, its answer is lost) when after is set, before it otherwise.
type lossy struct {
	base        http.RoundTripper
	lose, after atomic.Bool
	gateway     atomic.Bool // answer 502 in place of the answer, instead of an error
}

var errProxyLost = errors.New("connection reset by the test's proxy")

func (l *lossy) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method != http.MethodPost || !l.lose.Load() {
		return l.base.RoundTrip(r)
	}
	if !l.after.Load() {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, errProxyLost
	}
	resp, err := l.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if l.gateway.Load() {
		return &http.Response{StatusCode: http.StatusBadGateway, Header: http.Header{},
			Body: http.NoBody, Request: r}, nil
	}
	return nil, errProxyLost
}

// The lookup after a loop that ended without a definitive answer: the key
// from the ExhaustedError or from resp.Request; completed (the stored
// response), absent (then the re-send with the same key runs it once), in
// progress; scoped by the request's credentials.
func TestLookupAfterAnUnknownOutcome(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(0, 0)
		base, url := pipeServer(t, srv.mux)
		path := &lossy{base: base}
		tr := quietTransport(path, WithMaxAttempts(2))
		mon := url + "/operations/"

		// The answers lost after the server acted: completed.
		path.lose.Store(true)
		path.after.Store(true)
		req := payment(t, t.Context(), url, "")
		resp, err := tr.RoundTrip(req)
		require.Nil(t, resp)
		require.False(t, Definitive(resp, err))
		var ee *retry.ExhaustedError
		require.ErrorAs(t, err, &ee)
		path.lose.Store(false)
		res, err := tr.Lookup(t.Context(), mon, payment(t, t.Context(), url, ""), ee.Key)
		require.NoError(t, err)
		require.Equal(t, OperationCompleted, res.State)
		b, _ := io.ReadAll(res.Response.Body)
		res.Response.Body.Close()
		assert.Equal(t, http.StatusCreated, res.Response.StatusCode)
		assert.Equal(t, `{"charge":"ch_1"}`, string(b))
		assert.Equal(t, int64(1), srv.charges.Load(), "charged once, and not again")

		// Another principal learns nothing of it.
		other := payment(t, t.Context(), url, ee.Key)
		other.Header.Set("Authorization", "Bearer acct_2")
		res, err = tr.Lookup(t.Context(), mon, other, "")
		require.NoError(t, err)
		assert.Equal(t, OperationAbsent, res.State)

		// A gateway's 502 after forwarding: the key from resp.Request.
		path.lose.Store(true)
		path.gateway.Store(true)
		resp, err = tr.RoundTrip(payment(t, t.Context(), url, ""))
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusBadGateway, resp.StatusCode)
		require.False(t, Definitive(resp, err))
		path.lose.Store(false)
		res, err = tr.Lookup(t.Context(), mon, resp.Request, "")
		require.NoError(t, err)
		require.Equal(t, OperationCompleted, res.State)
		res.Response.Body.Close()
		assert.Equal(t, int64(2), srv.charges.Load())

		// Lost before reaching the server: absent; the re-send runs it.
		path.lose.Store(true)
		path.after.Store(false)
		path.gateway.Store(false)
		req = payment(t, t.Context(), url, "order-7")
		_, err = tr.RoundTrip(req)
		require.ErrorAs(t, err, &ee)
		path.lose.Store(false)
		res, err = tr.Lookup(t.Context(), mon, payment(t, t.Context(), url, "order-7"), "")
		require.NoError(t, err)
		require.Equal(t, OperationAbsent, res.State)
		assert.Nil(t, res.Response)
		assert.Equal(t, int64(2), srv.charges.Load(), "nothing ran")
		resp, err = tr.RoundTrip(payment(t, t.Context(), url, "order-7"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, int64(3), srv.charges.Load())
	})
}

// A request in progress: the lookup says so at once, with the wait the
// monitor asks for, even on a Transport that follows 202s.
func TestLookupInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newChargeServer(3*time.Second, 0)
		base, url := pipeServer(t, srv.mux)
		tr := quietTransport(base, WithFollowAccepted(true))
		done := make(chan struct{})
		go func() {
			defer close(done)
			resp, err := tr.RoundTrip(payment(t, context.Background(), url, "slow"))
			if assert.NoError(t, err) {
				resp.Body.Close()
			}
		}()
		time.Sleep(time.Second)
		start := time.Now()
		res, err := tr.Lookup(t.Context(), url+"/operations/", payment(t, t.Context(), url, "slow"), "")
		require.NoError(t, err)
		assert.Equal(t, OperationInProgress, res.State)
		assert.Equal(t, time.Second, res.RetryAfter)
		assert.Zero(t, time.Since(start), "not followed")
		<-done
	})
}

// Against a server without a monitor, the lookup says so (ErrNoMonitor):
// the caller falls back to sending the request again with the same key.
// A request without a key cannot be looked up.
func TestLookupRefusals(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mux := http.NewServeMux()
		mux.Handle("POST /payments", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		base, url := pipeServer(t, mux)
		tr := quietTransport(base)
		_, err := tr.Lookup(t.Context(), url+"/operations/", payment(t, t.Context(), url, "k"), "")
		require.ErrorIs(t, err, ErrNoMonitor)

		_, err = tr.Lookup(t.Context(), url+"/operations/", payment(t, t.Context(), url, ""), "")
		require.ErrorIs(t, err, keygen.ErrInvalidKey)

		srv := newChargeServer(0, 0)
		base, url = pipeServer(t, srv.mux)
		tr = quietTransport(base)
		anon := payment(t, t.Context(), url, "k")
		anon.Header.Del("Authorization")
		_, err = tr.Lookup(t.Context(), url+"/operations/", anon, "")
		require.Error(t, err)
		assert.NotErrorIs(t, err, ErrNoMonitor)
		assert.Contains(t, err.Error(), "401")
	})
}

// The one rule of an unknown outcome.
func TestDefinitive(t *testing.T) {
	resp := func(status int, header ...string) *http.Response {
		h := http.Header{}
		for i := 0; i+1 < len(header); i += 2 {
			h.Set(header[i], header[i+1])
		}
		return &http.Response{StatusCode: status, Header: h}
	}
	for _, tc := range []struct {
		resp *http.Response
		err  error
		want bool
	}{
		{resp(200), nil, true},
		{resp(201), nil, true},
		{resp(202), nil, true},
		{resp(202, "Location", "/operations/x"), nil, false},
		{resp(202, "Operation-Location", "/operations/x"), nil, false},
		{resp(400), nil, true},
		{resp(404), nil, true},
		{resp(409), nil, true},
		{resp(409, "Retry-After", "1"), nil, false},
		{resp(422), nil, true},
		{resp(429), nil, false},
		{resp(500), nil, true},
		{resp(502), nil, false},
		{resp(503), nil, false},
		{resp(504), nil, false},
		{nil, errProxyLost, false},
		{nil, &retry.ExhaustedError{Reason: retry.ReasonMaxAttempts}, false},
		{nil, nil, false},
	} {
		status := 0
		if tc.resp != nil {
			status = tc.resp.StatusCode
		}
		assert.Equal(t, tc.want, Definitive(tc.resp, tc.err), "%d %v %v", status, tc.err,
			tc.resp)
	}
	// The middleware's own answers.
	h := idempotency.New(nil, idempotency.WithLogger(nil)).Wrap(http.NotFoundHandler())
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/", nil)
	req.Header.Set("Idempotency-Key", "k")
	req.Header.Set("Authorization", "Bearer x")
	h.ServeHTTP(rec, req)
	assert.False(t, Definitive(rec.Result(), nil), "503 store unavailable")
}
