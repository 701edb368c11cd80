package idempotency

import (
	"encoding/hex"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// The largest limit there is still reads the body: limit+1 must not
// overflow into a limit that reads nothing.
func TestMaxRequestBodyOfMaxInt64ReadsTheBody(t *testing.T) {
	const body = `{"amount_cents":1999}`
	var got []byte
	h := New(NewMemoryStore(), WithAnonymousKeys(), WithMaxRequestBody(math.MaxInt64))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
	}))
	r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
	r.Header.Set("Idempotency-Key", "k-maxint")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated || string(got) != body {
		t.Fatalf("status %d, the handler read %q; want 201 and %q", w.Code, got, body)
	}
}

// A request's ID is 16 lower-case hex digits, never repeated.
func TestNewExecIDIsRandomHex(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := newExecID()
		if b, err := hex.DecodeString(id); err != nil || len(b) != 8 || hex.EncodeToString(b) != id {
			t.Fatalf("newExecID() = %q: not 16 lower-case hex digits", id)
		}
		if seen[id] {
			t.Fatalf("newExecID() repeated %q", id)
		}
		seen[id] = true
	}
}

// readBody reads the whole body whatever its declared length says, and
// refuses one over the limit.
func TestReadBodyIgnoresAWrongContentLength(t *testing.T) {
	body := strings.Repeat("x", 1500)
	for _, declared := range []int64{-1, 0, 1, 700, 1500, 4000} {
		r, err := http.NewRequest(http.MethodPost, "http://x/", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		r.ContentLength = declared
		got, err := readBody(r, 2000)
		if err != nil || string(got) != body {
			t.Fatalf("declared %d: read %d bytes, %v", declared, len(got), err)
		}
		r.Body = io.NopCloser(strings.NewReader(body))
		if _, err := readBody(r, 1499); !errors.Is(err, errTooLarge) {
			t.Fatalf("declared %d: a body over the limit gave %v", declared, err)
		}
	}
}
