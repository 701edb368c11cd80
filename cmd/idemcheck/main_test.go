package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newStore is the one place this file makes a store.
func newStore() idempotency.Store { return memstore.New() }

// serve serves the middleware on POST /payments, scoped by the
// Authorization header; each execution creates an effect eff_<n>. With
// dedupe false, the handler is served bare: every request runs.
func serve(t *testing.T, dedupe bool) string {
	t.Helper()
	var effects atomic.Int64
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
	})
	if dedupe {
		h = idempotency.New(newStore(), idempotency.WithLogger(slog.New(slog.DiscardHandler))).Wrap(h)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/payments"
}

// runCmd runs the command with args and returns its exit status, stdout
// and stderr.
func runCmd(args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := run(args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// flags are a caller's and a second principal's headers, the effect's id
// member and a JSON body.
var flags = []string{
	"-H", "Authorization: Bearer tok_1", "-H", "Content-Type: application/json",
	"-other", "Authorization: Bearer tok_2", "-id-field", "id", "-n", "4",
	"-d", `{"amount":4200}`,
}

func TestHelpExitsZero(t *testing.T) {
	for _, h := range []string{"-h", "-help", "--help"} {
		code, stdout, stderr := runCmd(h)
		require.Equal(t, 0, code)
		require.Contains(t, stdout, "usage: idemcheck [flags] URL")
		require.Contains(t, stdout, "-other 'Name: value'")
		require.Contains(t, stdout, "-timeout duration")
		require.Empty(t, stderr)
	}
}

func TestUsageErrorsExitTwo(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "give one URL"},
		{[]string{"http://a/", "http://b/"}, "give one URL"},
		{[]string{"-nope", "http://a/"}, "flag provided but not defined: -nope"},
		{[]string{"-H", "no colon", "http://a/"}, `want 'Name: value', got "no colon"`},
		{[]string{"-H", "Bad Name: x", "http://a/"}, `bad header name "Bad Name"`},
		{[]string{"-H", "Idempotency-Key: k", "http://a/"}, "the checker sets the key itself"},
		{[]string{"-d", "@/nonexistent/body.json", "http://a/"}, "no such file"},
		{[]string{"-max-time", "0s", "http://a/"}, "-max-time must be positive"},
		{[]string{"ftp://a/"}, "want http:// or https://"},
	} {
		code, stdout, stderr := runCmd(tc.args...)
		require.Equal(t, 2, code, tc.args)
		require.Empty(t, stdout, tc.args)
		require.Contains(t, stderr, tc.want, tc.args)
	}
}

func TestTargetDownExitsTwo(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	url := "http://" + ln.Addr().String() + "/payments"
	require.NoError(t, ln.Close())
	code, stdout, stderr := runCmd(url)
	require.Equal(t, 2, code)
	require.Empty(t, stdout)
	require.Contains(t, stderr, "could not be checked: no answer to the first request")
	require.Contains(t, stderr, "connection refused")

	code, _, stderr = runCmd("-wait", "200ms", url)
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "nothing accepted connections at "+ln.Addr().String()+" within 200ms (-wait)")
}

// With -json, stdout holds the report even when the target could not be
// checked: {"target": ..., "checks": [], "error": ...}, the error on stderr
// too, so that a CI step that saves stdout gets JSON with the reason.
func TestJSONWhenTheTargetCannotBeChecked(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	url := "http://" + ln.Addr().String() + "/payments"
	require.NoError(t, ln.Close())
	for _, args := range [][]string{{"-json", url}, {"-json", "ftp://a/"}, {"-json"}} {
		code, stdout, stderr := runCmd(args...)
		require.Equal(t, 2, code, args)
		var rep map[string]any
		require.NoError(t, json.Unmarshal([]byte(stdout), &rep), "%v: stdout %q", args, stdout)
		require.Equal(t, []string{"checks", "error", "target"}, keys(rep))
		require.Equal(t, []any{}, rep["checks"])
		require.NotEmpty(t, rep["error"])
		require.Equal(t, rep["error"].(string)+"\n", stderr, "the reason, in the JSON and on stderr")
	}
	_, stdout, stderr := runCmd("-json", url)
	require.Contains(t, stdout, `"target": "`+url+`"`)
	require.Contains(t, stderr, "could not be checked: no answer to the first request")
}

func TestTarget404ExitsTwo(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	code, stdout, stderr := runCmd(srv.URL + "/payments")
	require.Equal(t, 2, code)
	require.Empty(t, stdout)
	require.Contains(t, stderr, "its first answer is 404 Not Found, not a success (2xx)")
}

func TestMiddlewareExitsZero(t *testing.T) {
	url := serve(t, true)
	code, stdout, stderr := runCmd(append(flags, "-wait", "1s", url)...)
	require.Equal(t, 0, code, stdout+stderr)
	require.Empty(t, stderr)
	for _, name := range []string{"replay", "concurrent", "in_progress", "mismatch", "scope", "invalid_key", "marker"} {
		require.Regexp(t, `(?m)^(PASS|INFO|SKIP) `+name+`: `, stdout)
	}
	require.Contains(t, stdout, "no check failed (7 checks: ")
}

func TestBrokenServerExitsOne(t *testing.T) {
	url := serve(t, false)
	code, stdout, stderr := runCmd(append(flags, url)...)
	require.Equal(t, 1, code)
	require.Empty(t, stderr)
	require.Contains(t, stdout, "FAIL replay: a client that retries a timed-out POST /payments creates a second effect")
	require.Contains(t, stdout, "FAIL concurrent: ")
	require.Contains(t, stdout, "4 of 7 checks failed")
}

func TestJSONShape(t *testing.T) {
	url := serve(t, false)
	code, stdout, _ := runCmd(append([]string{"-json"}, append(flags, url)...)...)
	require.Equal(t, 1, code)
	var rep map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &rep))
	require.Equal(t, []string{"checks", "target"}, keys(rep))
	require.Equal(t, url, rep["target"])
	checks := rep["checks"].([]any)
	require.Len(t, checks, 7)
	results := map[string]string{}
	for _, c := range checks {
		c := c.(map[string]any)
		require.Equal(t, []string{"detail", "evidence", "name", "result"}, keys(c))
		require.Contains(t, []string{"pass", "fail", "skip", "info"}, c["result"])
		require.IsType(t, "", c["detail"])
		require.IsType(t, []any{}, c["evidence"], "evidence is a list, never null")
		results[c["name"].(string)] = c["result"].(string)
	}
	require.Equal(t, map[string]string{
		"replay": "fail", "concurrent": "fail", "in_progress": "skip", "mismatch": "fail",
		"scope": "pass", "invalid_key": "fail", "marker": "info",
	}, results)
}

func keys(m map[string]any) []string {
	var k []string
	for s := range m {
		k = append(k, s)
	}
	sort.Strings(k)
	return k
}

func TestBodyFromFile(t *testing.T) {
	var got atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.CompareAndSwap(nil, string(b))
		w.WriteHeader(http.StatusNotFound)
	}))
	defer srv.Close()
	file := filepath.Join(t.TempDir(), "body.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"from":"file"}`), 0o600))
	code, _, _ := runCmd("-d", "@"+file, srv.URL)
	require.Equal(t, 2, code)
	require.Equal(t, `{"from":"file"}`, got.Load())

	big := filepath.Join(t.TempDir(), "big")
	require.NoError(t, os.WriteFile(big, make([]byte, maxBodyFile+1), 0o600))
	code, _, stderr := runCmd("-d", "@"+big, srv.URL)
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "is larger than 10485760 bytes")
}

func TestParseHeader(t *testing.T) {
	for _, tc := range []struct{ in, name, value string }{
		{"Authorization: Bearer x", "Authorization", "Bearer x"},
		{"  X-A\t:\tv : w  ", "X-A", "v : w"},
		{"X-Empty:", "X-Empty", ""},
	} {
		name, value, err := parseHeader(tc.in)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.name, name, tc.in)
		require.Equal(t, tc.value, value, tc.in)
	}
	for _, in := range []string{"", "no colon", ": no name", " \t: x"} {
		_, _, err := parseHeader(in)
		require.Error(t, err, in)
	}
}

func FuzzParseHeader(f *testing.F) {
	f.Add("Authorization: Bearer x")
	f.Add(":")
	f.Add(" a :: b ")
	f.Fuzz(func(t *testing.T, s string) {
		name, value, err := parseHeader(s)
		if err != nil {
			return
		}
		if name == "" || strings.Contains(name, ":") || strings.Trim(name, " \t") != name ||
			strings.Trim(value, " \t") != value {
			t.Fatalf("parseHeader(%q) = %q, %q", s, name, value)
		}
		n2, v2, err := parseHeader(name + ": " + value)
		if err != nil || n2 != name || v2 != value {
			t.Fatalf("parseHeader does not read back %q: %q", s, name+": "+value)
		}
	})
}

// syncBuffer is a bytes.Buffer that a server's goroutine may read while the
// command writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Each check's verdict is printed as the check finishes, not at the end of
// the run: when the scope check's request (the second principal's)
// arrives, the verdicts of replay to mismatch are already out, on stdout,
// or with -json on stderr (stdout then holds the JSON alone, at the end).
func TestVerdictsArePrintedAsChecksFinish(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		t.Run(fmt.Sprint("json=", asJSON), func(t *testing.T) {
			var stdout, stderr syncBuffer
			var atScope atomic.Value
			var effects atomic.Int64
			h := idempotency.New(newStore(), idempotency.WithLogger(slog.New(slog.DiscardHandler))).
				Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.Header.Get("Authorization") == "Bearer tok_2" {
						atScope.CompareAndSwap(nil, stdout.String()+"\x00"+stderr.String())
					}
					w.WriteHeader(http.StatusCreated)
					fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
				}))
			srv := httptest.NewServer(h)
			defer srv.Close()
			args := append([]string{}, flags...)
			if asJSON {
				args = append(args, "-json")
			}
			require.Equal(t, 0, run(append(args, srv.URL), &stdout, &stderr), stdout.String()+stderr.String())
			out, errOut, _ := strings.Cut(atScope.Load().(string), "\x00")
			seen := out
			if asJSON {
				require.Empty(t, out, "stdout holds the JSON alone, at the end")
				seen = errOut
			}
			for _, name := range []string{"replay", "concurrent", "in_progress", "mismatch"} {
				require.Regexp(t, `(?m)^(PASS|INFO|SKIP) `+name+`: `, seen, "printed before the scope check ran")
			}
			require.NotContains(t, seen, " scope: ")
		})
	}
}

// -json reports an error that cuts a run short in its "error" member, with
// the checks that finished before it.
func TestJSONCarriesTheErrorOfARunCutShort(t *testing.T) {
	hang := make(chan struct{})
	var effects atomic.Int64
	h := idempotency.New(newStore(), idempotency.WithLogger(slog.New(slog.DiscardHandler))).
		Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasPrefix(r.Header.Get("Idempotency-Key"), "idemcheck-concurrent-") {
				<-hang // the concurrent check's execution answers after the run's end
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":"eff_%d"}`, effects.Add(1))
		}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	defer close(hang) // before the server closes: its handler waits for it
	code, stdout, stderr := runCmd(append([]string{"-json", "-max-time", "1s"}, append(flags, srv.URL)...)...)
	require.Equal(t, 2, code, stdout+stderr)
	var rep struct {
		Checks []struct{ Name string }
		Error  string
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &rep), stdout)
	require.Contains(t, rep.Error, "the run was cut short during the concurrent check")
	require.Len(t, rep.Checks, 2, "replay, and the concurrent check it cut short")
	require.Contains(t, stderr, rep.Error)
}
