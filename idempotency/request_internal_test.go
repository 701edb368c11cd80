package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"
)

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

// A stored request is encoded in encoding/json's form and decodes to what
// was encoded, whatever its bytes (encoding/json replaces invalid UTF-8 in
// strings with U+FFFD).
func FuzzStoredRequest(f *testing.F) {
	f.Add("POST", "/orders?a=1&b=<2>", "api.example", "application/json", []byte(`{"a":1}`))
	f.Add("PATCH", "/\u00e9\"\\\n", "", "", []byte{})
	f.Add("", "", "h\xff", "text/plain; charset=\"utf-8\"", []byte{0, 1, 2})
	f.Add("GET", "/a&b<c>\u2028\x7f", "h", "t\tx", []byte(nil))
	f.Fuzz(func(t *testing.T, method, url, host, ct string, body []byte) {
		in := storedRequest{Method: method, URL: url, Host: host, ContentType: ct, Body: body}
		enc := in.encode()
		meta, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		if want := append(append(meta, '\n'), body...); !bytes.Equal(enc, want) {
			t.Fatalf("encoded %q, encoding/json's form is %q", enc, want)
		}
		out, err := decodeRequest(enc)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range []string{method, url, host, ct} {
			if !utf8.ValidString(v) {
				return
			}
		}
		if len(in.Body) == 0 {
			in.Body = nil
		}
		if out.Method != in.Method || out.URL != in.URL || out.Host != in.Host ||
			out.ContentType != in.ContentType || string(out.Body) != string(in.Body) {
			t.Fatalf("decoded %+v, encoded %+v", out, in)
		}
	})
	if _, err := decodeRequest([]byte("{")); !errors.Is(err, errBadStoredRequest) {
		f.Fatalf("a malformed stored request: %v", err)
	}
}

// The body is stored as its own bytes after the JSON and its newline, not
// in base64, and decodes to those bytes; bytes without that newline are a
// malformed stored request.
func TestStoredRequestKeepsTheBodyAsBytes(t *testing.T) {
	body := []byte("{\"amount\":1}\n\x00\xff")
	in := storedRequest{Method: "POST", URL: "/pay", ContentType: "application/json",
		Body: body}
	enc := in.encode()
	want := `{"method":"POST","url":"/pay","content_type":"application/json"}` + "\n" +
		string(body)
	if string(enc) != want {
		t.Fatalf("encoded %q, want %q", enc, want)
	}
	got, err := decodeRequest(enc)
	if err != nil || got.Method != in.Method || got.URL != in.URL ||
		got.ContentType != in.ContentType || string(got.Body) != string(body) {
		t.Fatalf("decoded to %+v, %v; encoded %+v", got, err, in)
	}
	noNewline := []byte(`{"id":"id","method":"POST","url":"/pay","body":"eyJhbW91bnQiOjF9"}`)
	if _, err := decodeRequest(noNewline); !errors.Is(err, errBadStoredRequest) {
		t.Fatalf("a stored request without its newline: %v", err)
	}
}
