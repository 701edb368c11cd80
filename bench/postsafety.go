package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
)

// POSTCase is one situation of scenario (d).
type POSTCase struct {
	Name string
	// Fail tells how the server treats attempt n (1-based) of the logical
	// request: "503", "reset" (read the whole body, then close the
	// connection without answering) or "" (answer 200).
	Fail func(n int) string
	// NoGetBody sends the body as a plain io.Reader without GetBody.
	NoGetBody bool
	// CallerKey is an Idempotency-Key the caller sets itself ("" for none).
	CallerKey string
}

// POSTCases are the situations of scenario (d). The first failure only ever
// hits attempt 1; attempt 2 and later are answered 200.
var POSTCases = []POSTCase{
	{Name: "503 once", Fail: failFirst("503")},
	{Name: "reset after body", Fail: failFirst("reset")},
	{Name: "503 once, body without GetBody", Fail: failFirst("503"), NoGetBody: true},
	{Name: "503 once, caller's key", Fail: failFirst("503"), CallerKey: "order-confirm-42"},
}

func failFirst(how string) func(int) string {
	return func(n int) string {
		if n == 1 {
			return how
		}
		return ""
	}
}

// POSTRow is what the server saw of one logical POST.
type POSTRow struct {
	Client, Case string
	Hits         int      // attempts that reached the server
	Keys         []string // Idempotency-Key of each attempt ("" when absent)
	BodyIntact   bool     // every attempt carried the full original body
	Result       string   // the caller's outcome: a status or an error
	CallerKey    string
}

// Retried tells whether the client sent the request more than once.
func (r POSTRow) Retried() bool { return r.Hits > 1 }

// KeyOnEvery tells whether every attempt carried a key.
func (r POSTRow) KeyOnEvery() bool {
	for _, k := range r.Keys {
		if k == "" {
			return false
		}
	}
	return len(r.Keys) > 0
}

// KeyStable tells whether every attempt carried the same non-empty key, and
// the caller's own when it set one.
func (r POSTRow) KeyStable() bool {
	if !r.KeyOnEvery() {
		return false
	}
	for _, k := range r.Keys {
		if k != r.Keys[0] {
			return false
		}
	}
	return r.CallerKey == "" || r.Keys[0] == r.CallerKey
}

// Verdict sums the row up.
func (r POSTRow) Verdict() string {
	switch {
	case !r.Retried():
		return "not retried"
	case !r.KeyOnEvery():
		return "UNSAFE: POST retried without a key"
	case !r.KeyStable():
		return "UNSAFE: key changed between attempts"
	case !r.BodyIntact:
		return "BROKEN: body not rewound"
	default:
		return "safe retry (same key, same body)"
	}
}

// postPayload is the body of every scenario (d) request.
var postPayload = []byte(`{"order":"42","amount_cents":1999,"note":"` + strings.Repeat("x", 960) + `"}`)

// RunPOSTCase sends one logical POST through contender c to a fresh
// loopback server that fails as pc says, and reports what the server saw.
// Every contender runs with its default waits.
func RunPOSTCase(c Contender, pc POSTCase) (POSTRow, error) {
	row := POSTRow{Client: c.Name, Case: pc.Name, BodyIntact: true, CallerKey: pc.CallerKey}
	var mu sync.Mutex
	srv := NewServer(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		mu.Lock()
		row.Hits++
		n := row.Hits
		row.Keys = append(row.Keys, r.Header.Get("Idempotency-Key"))
		if err != nil || !bytes.Equal(body, postPayload) {
			row.BodyIntact = false
		}
		mu.Unlock()
		switch pc.Fail(n) {
		case "503":
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
		case "reset":
			hj, ok := w.(http.Hijacker)
			if !ok {
				http.Error(w, "bench: server cannot hijack", http.StatusInternalServerError)
				return
			}
			conn, _, err := hj.Hijack()
			if err == nil {
				conn.Close()
			}
		default:
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(Body)
		}
	})
	defer srv.Close()
	base := NewBaseTransport()
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: c.Wrap(base, DefaultWaits)}

	var body io.Reader = bytes.NewReader(postPayload)
	if pc.NoGetBody {
		body = struct{ io.Reader }{bytes.NewReader(postPayload)} // hides the type: no GetBody
	}
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL+"/orders", body)
	if err != nil {
		return row, err
	}
	req.Header.Set("Content-Type", "application/json")
	if pc.CallerKey != "" {
		req.Header.Set("Idempotency-Key", pc.CallerKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		row.Result = "error: " + shorten(strings.Join(strings.Fields(err.Error()), " "), 60)
	} else {
		Drain(resp)
		row.Result = fmt.Sprint(resp.StatusCode)
	}
	mu.Lock()
	defer mu.Unlock()
	out := row
	out.Keys = append([]string(nil), row.Keys...)
	return out, nil
}

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// POSTSafetyTable runs every case against every contender and returns a
// markdown table.
func POSTSafetyTable() (string, error) {
	var b strings.Builder
	b.WriteString("| client | case | server hits | key on every attempt | key stable | body intact | caller got | verdict |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, pc := range POSTCases {
		for _, c := range Contenders {
			row, err := RunPOSTCase(c, pc)
			if err != nil {
				return "", fmt.Errorf("%s / %s: %w", c.Name, pc.Name, err)
			}
			stable := "n/a (one attempt)"
			if row.Retried() {
				stable = yesNo(row.KeyStable())
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s | %s |\n", row.Client, row.Case, row.Hits,
				yesNo(row.KeyOnEvery()), stable, yesNo(row.BodyIntact),
				strings.ReplaceAll(row.Result, "|", "/"), row.Verdict())
		}
	}
	return b.String(), nil
}

func yesNo(v bool) string {
	if v {
		return "yes"
	}
	return "no"
}
