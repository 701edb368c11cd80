package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/saferetry/saferetry/idemcheck"
	"github.com/saferetry/saferetry/keygen"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestRun(t *testing.T) {
	var buf bytes.Buffer
	res, err := run(context.Background(), &buf)
	require.NoError(t, err)
	out := buf.String()
	t.Log("\n" + out)

	require.Equal(t, http.StatusCreated, res.status)
	require.True(t, res.replayed, "the client got the stored response after the lost answer")
	require.JSONEq(t, `{"order":"ord_42","charge":"ch_1","status":"paid"}`, res.body)
	require.Equal(t, 3, res.serverRequests, "503, lost answer, replay")
	require.Equal(t, 1, res.orders)
	require.Equal(t, 1, res.receipts)
	require.Equal(t, 1, res.charges)
	require.Equal(t, 2, res.chargeCalls, "one while the processor was down, one charge")
	require.Equal(t, 1, res.lookups, "the resumed attempt asked before charging")
	require.Len(t, res.keys, 1)
	require.True(t, strings.HasPrefix(res.keys[0], "charge-"), res.keys[0])
	require.NotContains(t, res.keys[0], "order-pay-42", "the client's key never reaches the processor")
	require.Equal(t, http.StatusUnauthorized, res.forgedStatus, "the principal comes from a verified token, not from a header")
	require.True(t, res.ok())

	// The narrative, in order.
	want := []string{
		"client: POST /payments for order 42 with Idempotency-Key order-pay-42",
		"server: request 1",
		"phase order: created ord_42",
		"processor: down (503)",
		"server: answered 503",
		"server: request 2",
		"phase order: committed by an earlier attempt, skipped (ord_42)",
		"an intent without an outcome; asking the processor first",
		"no such charge",
		"processor: charged 42.00 EUR as ch_1",
		"receipt for ord_42/ch_1 written",
		"the connection drops before the client reads it",
		"server: request 3",
		"server: answered 201, a replay of the stored response",
		"client: got 201",
		"intruder: got 401",
		"database: 1 order, 1 receipt; processor: 1 charge from 2 charge calls",
	}
	at := 0
	for _, w := range want {
		i := strings.Index(out[at:], w)
		require.GreaterOrEqual(t, i, 0, "missing (in order): %q", w)
		at += i + len(w)
	}
	require.NotContains(t, strings.ToLower(out), "exactly once")
}

func TestHelpPrintsTheUsage(t *testing.T) {
	var buf bytes.Buffer
	_, err := parseFlags([]string{"-h"}, &buf)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.True(t, strings.HasPrefix(buf.String(), "Usage: go run ./examples/payments"), buf.String())
	require.Contains(t, buf.String(), "-delay")
	_, err = parseFlags([]string{"extra"}, io.Discard)
	require.Error(t, err)
	cfg, err := parseFlags([]string{"-serve", "127.0.0.1:0", "-delay", "200ms"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, config{serve: "127.0.0.1:0", delay: 200 * time.Millisecond}, cfg)
}

// The processor finds a charge under the key it was made with, escaped into
// the lookup's path as the payments API escapes it: a downstream key from
// keygen.Event holds escapes of its own ("%2D").
func TestProcessorLooksUpAChargeByItsKey(t *testing.T) {
	proc := &processor{out: &printer{w: io.Discard}, charges: map[string]string{}}
	srv := httptest.NewServer(proc)
	defer srv.Close()
	for _, key := range []string{keygen.Event("order-pay-42", "charge", "16694b26-4d60"), "a/b c%2Dd"} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		charge, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)

		resp, err = srv.Client().Get(srv.URL + "/charges/" + url.PathEscape(key))
		require.NoError(t, err)
		found, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, key)
		require.Equal(t, string(charge), string(found), key)
	}
}

// TestServeIsAnIdemcheckTarget serves the API as -serve -delay 200ms does
// and runs the idemcheck checker against it, as the server guide's section does:
// no check fails or is skipped, and every run pays once per key it meant
// to pay with.
func TestServeIsAnIdemcheckTarget(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- serve(ctx, ln, &out, 200*time.Millisecond) }()

	rep, err := idemcheck.Run(t.Context(), idemcheck.Config{
		URL:  "http://" + ln.Addr().String() + "/payments",
		Body: []byte(`{"order":"42","amount":4200}`),
		Header: http.Header{
			"Authorization": {"Bearer tok_demo_acct_1"},
			"Content-Type":  {"application/json"},
		},
		Other:         http.Header{"Authorization": {"Bearer tok_demo_acct_2"}},
		IDField:       "charge",
		N:             4,
		MaxRetryAfter: 10 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Log("\n" + rep.String())
	require.False(t, rep.Failed())
	for _, c := range rep.Checks { // -delay: duplicates arrive while the first runs
		require.NotEqual(t, idemcheck.Skip, c.Result, "%s: %s", c.Name, c.Detail)
	}
	cancel()
	require.NoError(t, <-done)
	require.Contains(t, out.String(), "payments: serving POST http://"+ln.Addr().String()+"/payments")
	// The first two requests, the concurrent key, the mismatch control,
	// the second account and the two marker keys: seven payments.
	require.Contains(t, out.String(), "payments: stopped; 7 orders, 7 charges")
}
