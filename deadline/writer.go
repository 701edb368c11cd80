package deadline

import (
	"bufio"
	"io"
	"net"
	"net/http"

	"github.com/saferetry/saferetry/internal/hop"
)

// markWriter is the writer Middleware gives its handler: it adds the mark to
// a 5xx or 429 status, before it is written, when the record says that the
// request's failure was retried below. It holds the record too, so that a
// request costs one allocation for both.
type markWriter struct {
	http.ResponseWriter
	rec   hop.Record
	wrote bool // a final status (or the implicit 200) went out
}

// WriteHeader marks a 5xx or 429 status when the record asks for it, then
// writes it. Informational (1xx) statuses pass as they are.
func (w *markWriter) WriteHeader(code int) {
	if !w.wrote && code >= 200 {
		w.wrote = true
		if (code >= 500 || code == http.StatusTooManyRequests) && w.rec.RetriedBelow() {
			hop.Mark(w.ResponseWriter.Header())
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write writes b; without a status written first, that is a 200.
func (w *markWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

// WriteString writes s, with the underlying writer's WriteString when it
// has one; without a status written first, that is a 200.
func (w *markWriter) WriteString(s string) (int, error) {
	w.wrote = true
	return io.WriteString(w.ResponseWriter, s)
}

// ReadFrom copies from src, with the underlying writer's ReadFrom when it
// has one (net/http's uses sendfile); without a status written first, that
// is a 200.
func (w *markWriter) ReadFrom(src io.Reader) (int64, error) {
	w.wrote = true
	return io.Copy(w.ResponseWriter, src)
}

// FlushError flushes the underlying writer (http.ResponseController uses
// it); without a status written first, that sends a 200.
func (w *markWriter) FlushError() error {
	w.wrote = true
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Flush is FlushError without its error, for http.Flusher.
func (w *markWriter) Flush() { _ = w.FlushError() }

// Unwrap returns the underlying writer, for http.ResponseController.
func (w *markWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// hijackWriter is a markWriter over a writer that is an http.Hijacker.
type hijackWriter struct{ *markWriter }

// Hijack hands the connection over; nothing is marked after it.
func (w hijackWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	w.wrote = true
	return http.NewResponseController(w.ResponseWriter).Hijack()
}
