package deadline

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/internal/hop"
)

// noted is a handler that notes in its record, as a saferetry Transport
// does after a call whose failure was retried, then runs h.
func noted(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hop.FromContext(r.Context()).NoteRetriedBelow()
		h(w, r)
	})
}

func record(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	Middleware(h).ServeHTTP(rec, r)
	return rec
}

func TestMarksA5xxOr429AfterAPushback(t *testing.T) {
	for status, marked := range map[int]bool{500: true, 502: true, 503: true, 504: true, 599: true, 429: true,
		200: false, 204: false, 400: false, 404: false, 409: false, 422: false} {
		rec := record(noted(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(status) }),
			httptest.NewRequest(http.MethodGet, "/", nil))
		assert.Equal(t, status, rec.Code)
		assert.Equal(t, marked, rec.Header().Get("Retried-Below") == "true", "status %d", status)
	}
	// http.Error, as handlers answer.
	rec := record(noted(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", http.StatusServiceUnavailable) }),
		httptest.NewRequest(http.MethodGet, "/", nil))
	assert.Equal(t, []string{"true"}, rec.Header().Values("Retried-Below"))
	assert.Equal(t, "down\n", rec.Body.String())
}

func TestNoPushbackNoMark(t *testing.T) {
	rec := record(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) }),
		httptest.NewRequest(http.MethodGet, "/", nil))
	assert.Equal(t, 503, rec.Code)
	assert.Empty(t, rec.Header().Values("Retried-Below"))
}

// Only the final status counts: a 1xx passes unmarked, and a status noted
// after the answer was written (a body without WriteHeader, a flush) is
// never marked.
func TestOnlyTheFinalStatusIsMarked(t *testing.T) {
	srv := httptest.NewServer(Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := hop.FromContext(r.Context())
		switch r.URL.Path {
		case "/early-hints":
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			rec.NoteRetriedBelow()
			w.WriteHeader(503)
		case "/write-first":
			io.WriteString(w, "ok")
			rec.NoteRetriedBelow()
			w.WriteHeader(503) // superfluous: the 200 went out
		case "/flush-first":
			http.NewResponseController(w).Flush()
			rec.NoteRetriedBelow()
			w.WriteHeader(503)
		}
	})))
	defer srv.Close()
	for path, want := range map[string]struct {
		status int
		marked bool
	}{"/early-hints": {503, true}, "/write-first": {200, false}, "/flush-first": {200, false}} {
		resp, err := srv.Client().Get(srv.URL + path)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, want.status, resp.StatusCode, path)
		assert.Equal(t, want.marked, resp.Header.Get("Retried-Below") == "true", path)
	}
}

// A flush that the server's writer cannot do (http.TimeoutHandler's writer
// has no Flush) sends nothing: the status written after it is still the
// final one, and marked.
func TestAFlushThatSendsNothingLeavesTheStatusMarkable(t *testing.T) {
	for _, flush := range map[string]func(w http.ResponseWriter) error{
		"ResponseController": func(w http.ResponseWriter) error { return http.NewResponseController(w).Flush() },
		"Flusher":            func(w http.ResponseWriter) error { w.(http.Flusher).Flush(); return nil },
	} {
		h := http.TimeoutHandler(Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_ = flush(w)
			hop.FromContext(r.Context()).NoteRetriedBelow()
			w.WriteHeader(http.StatusServiceUnavailable)
		})), time.Minute, "timed out")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		assert.Equal(t, http.StatusServiceUnavailable, rec.Code)
		assert.Equal(t, []string{"true"}, rec.Header().Values("Retried-Below"))
	}
	err := func() error {
		var err error
		Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			err = http.NewResponseController(w).Flush()
		})).ServeHTTP(struct{ http.ResponseWriter }{httptest.NewRecorder()},
			httptest.NewRequest(http.MethodGet, "/", nil))
		return err
	}()
	assert.ErrorIs(t, err, http.ErrNotSupported, "the flush's error reaches the handler")
}

// The writer keeps what net/http's writer can do: http.Flusher,
// http.Hijacker (HTTP/1), http.ResponseController's deadlines through
// Unwrap, io.ReaderFrom and io.StringWriter.
func TestTheWriterKeepsFlushHijackAndResponseController(t *testing.T) {
	srv := httptest.NewServer(Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/flush":
			f, ok := w.(http.Flusher)
			if !ok {
				w.WriteHeader(500)
				return
			}
			io.WriteString(w, "a")
			f.Flush()
			io.WriteString(w, "b")
		case "/controller":
			rc := http.NewResponseController(w)
			if err := rc.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if err := rc.EnableFullDuplex(); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			io.WriteString(w, "deadline set")
		case "/hijack":
			hj, ok := w.(http.Hijacker)
			if !ok {
				w.WriteHeader(500)
				return
			}
			conn, buf, err := hj.Hijack()
			if err != nil {
				return
			}
			defer conn.Close()
			buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nhijacked")
			buf.Flush()
		case "/writestring":
			sw, ok := w.(io.StringWriter)
			if !ok {
				w.WriteHeader(500)
				return
			}
			sw.WriteString("string")
		case "/readfrom":
			rf, ok := w.(io.ReaderFrom)
			if !ok {
				w.WriteHeader(500)
				return
			}
			rf.ReadFrom(strings.NewReader("copied"))
		}
	})))
	defer srv.Close()
	for path, want := range map[string]string{"/flush": "ab", "/controller": "deadline set",
		"/hijack": "hijacked", "/readfrom": "copied", "/writestring": "string"} {
		resp, err := srv.Client().Get(srv.URL + path)
		require.NoError(t, err, path)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		assert.Equal(t, 200, resp.StatusCode, path)
		assert.Equal(t, want, string(body), path)
	}
}

// The writer has exactly the optional interfaces of the server's own, over
// HTTP/1 and HTTP/2, and they work: a handler's type assertion (a
// server-sent events handler's unchecked w.(http.CloseNotifier)) gets the
// answer it gets without the middleware.
func TestTheWriterHasTheServersInterfaces(t *testing.T) {
	probe := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var got []string
		if _, ok := w.(http.Flusher); ok {
			got = append(got, "Flusher")
		}
		if _, ok := w.(http.Hijacker); ok {
			got = append(got, "Hijacker")
		}
		//lint:ignore SA1019 handlers still assert it
		if cn, ok := w.(http.CloseNotifier); ok {
			got = append(got, "CloseNotifier", "notifies="+boolString(cn.CloseNotify() != nil))
		}
		if p, ok := w.(http.Pusher); ok {
			got = append(got, "Pusher", "push="+fmt.Sprint(p.Push("/style.css", nil)))
		}
		if _, ok := w.(io.ReaderFrom); ok {
			got = append(got, "ReaderFrom")
		}
		if _, ok := w.(io.StringWriter); ok {
			got = append(got, "StringWriter")
		}
		io.WriteString(w, r.Proto+" "+strings.Join(got, " "))
	})
	// onlyHijacker is a middleware's wrapper in between that keeps
	// http.Hijacker but not the deprecated http.CloseNotifier.
	onlyHijacker := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			next.ServeHTTP(struct {
				http.ResponseWriter
				http.Hijacker
				http.Flusher
				io.ReaderFrom
				io.StringWriter
			}{w, w.(http.Hijacker), w.(http.Flusher), w.(io.ReaderFrom), w.(io.StringWriter)}, r)
		})
	}
	for _, tc := range []struct {
		name    string
		h2      bool
		wrapper func(http.Handler) http.Handler
	}{
		{"HTTP/1", false, nil},
		{"HTTP/2", true, nil},
		{"HTTP/1 through a wrapper without CloseNotifier", false, onlyHijacker},
	} {
		sets := map[bool]string{}
		for _, behind := range []bool{false, true} {
			var h http.Handler = probe
			if behind {
				h = Middleware(probe)
			}
			if tc.wrapper != nil {
				h = tc.wrapper(h)
			}
			srv := httptest.NewUnstartedServer(h)
			srv.EnableHTTP2 = tc.h2
			srv.StartTLS()
			resp, err := srv.Client().Get(srv.URL)
			require.NoError(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			srv.Close()
			sets[behind] = string(body)
		}
		t.Log(sets[false])
		assert.Equal(t, sets[false], sets[true], tc.name)
	}
}

func boolString(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

func TestAttempt(t *testing.T) {
	assert.Zero(t, Attempt(context.Background()), "no middleware")
	for _, tc := range []struct {
		values []string
		want   int
	}{{nil, 0}, {[]string{"1"}, 1}, {[]string{" 3 "}, 3}, {[]string{"0"}, 0}, {[]string{"-2"}, 0},
		{[]string{"1", "2"}, 0}, {[]string{"soon"}, 0}, {[]string{"99999999999"}, 0}} {
		var got int
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header["Request-Attempt"] = tc.values
		record(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got = Attempt(context.WithoutCancel(r.Context()))
		}), r)
		assert.Equal(t, tc.want, got, "%q", tc.values)
	}
}

// The deadline and the record together: a handler sees both.
func TestDeadlineAndAttemptTogether(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set(Header, "60000")
	r.Header.Set("Request-Attempt", "2")
	var has bool
	var n int
	record(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, has = r.Context().Deadline()
		n = Attempt(r.Context())
	}), r)
	assert.True(t, has)
	assert.Equal(t, 2, n)
}
