package main

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// The bash retry loop published in docs/CONTRACT.md, run against the real
// middleware: it must end with one execution whatever the faults, never
// retry a definitive answer, and give up after 5 attempts.

// contractScript extracts the ```bash block of docs/CONTRACT.md. The backoff
// ceilings are scaled from 1 s to 10 ms so the test does not sleep seconds;
// nothing else is changed.
func contractScript(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "CONTRACT.md"))
	require.NoError(t, err)
	_, rest, ok := strings.Cut(string(doc), "```bash\n")
	require.True(t, ok, "CONTRACT.md has a bash block")
	script, _, ok := strings.Cut(rest, "```")
	require.True(t, ok)
	const ceiling = "ceiling=$(( 1000 << (attempt - 1) ))"
	require.Contains(t, script, ceiling, "the 1, 2, 4, 8 s ceilings")
	return strings.Replace(script, ceiling, "ceiling=$(( 10 << (attempt - 1) ))", 1)
}

// contractServer is a payments API behind the middleware; faults[i] decides
// what the i-th request that reaches it gets: "503" before the handler,
// "marked" (a 503 with Retried-Below: true), "lost" (the handler commits, a
// 502 replaces its answer), or "" (normal).
type contractServer struct {
	executions atomic.Int64
	mu         sync.Mutex
	requests   int
	faults     []string
	keys       []string
	attempts   []string // the Request-Attempt of each request
	h          http.Handler
}

func newContractServer(faults ...string) *contractServer {
	s := &contractServer{faults: faults}
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.executions.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, n)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idempotency.New(memstore.New()).Wrap(pay))
	s.h = mux
	return s
}

func (s *contractServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	fault := ""
	if s.requests < len(s.faults) {
		fault = s.faults[s.requests]
	}
	s.requests++
	s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
	s.attempts = append(s.attempts, r.Header.Get("Request-Attempt"))
	s.mu.Unlock()
	switch fault {
	case "503":
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	case "busy": // the middleware's in-progress answer, with a zero Retry-After
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Retry-After", "0")
		w.WriteHeader(http.StatusConflict)
		fmt.Fprintf(w, `{"status":409,"code":%q}`, idempotency.CodeInProgress)
	case "slow-down": // asks for more than the loop will wait
		w.Header().Set("Retry-After", "31")
		http.Error(w, "slow down", http.StatusTooManyRequests)
	case "marked": // a failure already retried further down a chain of services
		w.Header().Set("Retried-Below", "true")
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
	case "TRUE", "true, true": // no mark: another spelling, a list
		w.Header().Set("Retried-Below", fault)
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
	case "marked twice": // no mark: two field lines
		w.Header()["Retried-Below"] = []string{"true", "true"}
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
	case "marked busy": // no mark: the in-progress 409 is no failure
		w.Header().Set("Retried-Below", "true")
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusConflict)
		fmt.Fprintf(w, `{"status":409,"code":%q}`, idempotency.CodeInProgress)
	case "lost":
		s.h.ServeHTTP(httptest.NewRecorder(), r) // it runs and commits...
		http.Error(w, "bad gateway", http.StatusBadGateway)
	default:
		s.h.ServeHTTP(w, r)
	}
}

func runScript(t *testing.T, script, url string) (code int, stdout, stderr string) {
	t.Helper()
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("bash not found")
	}
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl not found")
	}
	cmd := exec.Command(bash, "-c", script)
	cmd.Env = append(os.Environ(), "URL="+url, "TOKEN=t-1")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err = cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), out.String(), errb.String()
	}
	require.NoError(t, err)
	return 0, out.String(), errb.String()
}

func TestContractScriptRetriesWithOneKey(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer("503", "busy", "lost")
	ts := httptest.NewServer(srv)
	defer ts.Close()

	code, out, errOut := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 0, code, "stderr: %s", errOut)
	require.Equal(t, int64(1), srv.executions.Load(), "the lost answer was replayed, not re-executed")
	require.Contains(t, out, `{"payment":1}`)
	require.Contains(t, errOut, "a replay")
	require.Equal(t, []string{"order-charge-42", "order-charge-42", "order-charge-42", "order-charge-42"}, srv.keys)
}

func TestContractScriptStopsOnDefinitiveAnswer(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer()
	ts := httptest.NewServer(srv)
	defer ts.Close()
	// The key was already used for another payment by the same caller.
	req, err := http.NewRequest(http.MethodPost, ts.URL+"/payments", strings.NewReader(`{"order":"41"}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer t-1")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "order-charge-42")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()

	code, out, _ := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 1, code)
	require.Contains(t, out, idempotency.CodeKeyReused)
	require.Equal(t, 2, len(srv.keys), "no retry of a 422")
	require.Equal(t, int64(1), srv.executions.Load())
}

func TestContractScriptGivesUpAfterFiveAttempts(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer("503", "503", "503", "503", "503", "503")
	ts := httptest.NewServer(srv)
	defer ts.Close()

	code, _, errOut := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "SAME key (order-charge-42)")
	require.Len(t, srv.keys, 5)
	require.Zero(t, srv.executions.Load())
}

func TestContractScriptStopsOnLongRetryAfter(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer("slow-down")
	ts := httptest.NewServer(srv)
	defer ts.Close()

	code, _, _ := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 2, code, "outcome unknown: re-send later")
	require.Len(t, srv.keys, 1, "a Retry-After over 30 s is not slept")
}

// An answer marked Retried-Below: true is never retried (CONTRACT.md
// section 8), and every attempt carries its number.
func TestContractScriptStopsOnAMarkedAnswer(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer("503", "marked")
	ts := httptest.NewServer(srv)
	defer ts.Close()

	code, _, errOut := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 2, code, "outcome unknown: re-send later")
	require.Contains(t, errOut, "SAME key (order-charge-42)")
	require.Equal(t, []string{"1", "2"}, srv.attempts, "no third attempt after the mark")
	require.Zero(t, srv.executions.Load())
}

// The mark is exactly "true" on one field line of a 5xx or 429 (CONTRACT.md
// section 8): any other spelling, a list, two field lines or the mark on an
// in-progress 409 is no mark, and the loop retries as it would without it.
func TestContractScriptReadsTheMarkExactly(t *testing.T) {
	script := contractScript(t)
	srv := newContractServer("TRUE", "true, true", "marked twice", "marked busy")
	ts := httptest.NewServer(srv)
	defer ts.Close()

	code, out, errOut := runScript(t, script, ts.URL+"/payments")
	require.Equal(t, 0, code, "stderr: %s", errOut)
	require.Contains(t, out, `{"payment":1}`)
	require.Equal(t, []string{"1", "2", "3", "4", "5"}, srv.attempts, "retried past every false mark")
	require.Equal(t, int64(1), srv.executions.Load())
}
