package saferetry_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// quiet are the options of these examples: short waits, no logs, a budget
// of their own.
var quiet = []saferetry.Option{
	saferetry.WithBackoff(jitter.Config{Base: time.Millisecond, ThrottleBase: time.Millisecond}),
	saferetry.WithLogger(nil),
	saferetry.WithBudget(budget.Unlimited()),
}

// Retry 500 on one host only, and never retry 503 on a path whose backend
// sheds load on purpose.
func ExampleWithRetryPolicy() {
	srv := flakyServer() // 503, 503, then 200
	defer srv.Close()
	deny503 := retry.Status(retry.Deny, http.StatusServiceUnavailable)
	noRetryOnReports := func(in retry.Input, d retry.Decision) retry.Verdict {
		if !strings.HasPrefix(in.Request.URL.Path, "/reports/") {
			return retry.Keep
		}
		return deny503(in, d)
	}
	allow500 := retry.Status(retry.Allow, http.StatusInternalServerError)
	retry500OnLedger := func(in retry.Input, d retry.Decision) retry.Verdict {
		if in.Request.URL.Host != "ledger.internal" {
			return retry.Keep
		}
		return allow500(in, d)
	}

	client := &http.Client{Transport: saferetry.NewTransport(nil,
		append(quiet, saferetry.WithRetryPolicy(noRetryOnReports, retry500OnLedger))...)}
	resp, err := client.Get(srv.URL + "/reports/daily")
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode)
	// Output: 503
}

// go-retryablehttp's DefaultRetryPolicy retries every 5xx but 501. A rule
// gets that here, for requests that are safe to repeat.
func ExampleWithRetryPolicy_every5xxBut501() {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.WriteHeader(http.StatusInsufficientStorage) // 507
			return
		}
		fmt.Fprint(w, "ok")
	}))
	defer srv.Close()
	every5xxBut501 := func(in retry.Input, _ retry.Decision) retry.Verdict {
		if in.Response != nil && in.Response.StatusCode >= 500 && in.Response.StatusCode != 501 {
			return retry.Allow
		}
		return retry.Keep
	}
	client := &http.Client{Transport: saferetry.NewTransport(nil,
		append(quiet, saferetry.WithRetryPolicy(every5xxBut501))...)}
	resp, err := client.Get(srv.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, "after", n.Load(), "attempts")
	// Output: 200 after 2 attempts
}

// Sign every attempt with a fresh timestamp: a retry is signed anew.
func ExampleWithPrepare() {
	secret := []byte("webhook-secret")
	srv := flakyServer()
	defer srv.Close()
	sign := func(r *http.Request, attempt int) error {
		body, err := r.GetBody() // a fresh copy of the body, to hash
		if err != nil {
			return err
		}
		defer body.Close()
		payload, err := io.ReadAll(body)
		if err != nil {
			return err
		}
		mac := hmac.New(sha256.New, secret)
		fmt.Fprintf(mac, "%d.%s", time.Now().Unix(), payload)
		r.Header.Set("X-Signature", hex.EncodeToString(mac.Sum(nil)))
		fmt.Println("signed attempt", attempt)
		return nil
	}
	client := &http.Client{Transport: saferetry.NewTransport(nil, append(quiet, saferetry.WithPrepare(sign))...)}
	resp, err := client.Post(srv.URL, "application/json", strings.NewReader(`{"event":"paid"}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode)
	// Output:
	// signed attempt 1
	// signed attempt 2
	// signed attempt 3
	// 200
}

// Count retries by the class of the outcome retried.
func ExampleWithObserver() {
	srv := flakyServer()
	defer srv.Close()
	retries := map[retry.Class]int{}
	obs := saferetry.Observer{
		AttemptDone: func(_ context.Context, a saferetry.AttemptDoneInfo) {
			if a.Outcome == saferetry.OutcomeRetry {
				retries[a.Decision.Class]++ // one goroutine here; use a lock or atomics when shared
			}
		},
		CallDone: func(_ context.Context, c saferetry.CallDoneInfo) {
			fmt.Println("attempts:", c.Attempts, "outcome:", c.Outcome)
		},
	}
	client := &http.Client{Transport: saferetry.NewTransport(nil, append(quiet, saferetry.WithObserver(obs))...)}
	resp, err := client.Get(srv.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()
	fmt.Println(retries)
	// Output:
	// attempts: 3 outcome: final
	// map[status_503:2]
}
