package deadline

import (
	"bufio"
	"errors"
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
		if hop.Failure(code) && w.rec.RetriedBelow() {
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

// FlushError flushes the underlying writer (http.ResponseController uses
// it); without a status written first, that sends a 200. A writer that
// cannot flush (http.ErrNotSupported) sends nothing, so the status is still
// to come.
func (w *markWriter) FlushError() error {
	err := http.NewResponseController(w.ResponseWriter).Flush()
	if !errors.Is(err, http.ErrNotSupported) {
		w.wrote = true
	}
	return err
}

// Flush is FlushError without its error, for http.Flusher.
func (w *markWriter) Flush() { _ = w.FlushError() }

// Unwrap returns the underlying writer, for http.ResponseController.
func (w *markWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// wrap returns the writer Middleware gives its handler over w: mw, with
// exactly the optional interfaces of w among those of net/http's own
// writers. It picks one of their combinations: HTTP/1's (http.Hijacker,
// http.CloseNotifier, io.ReaderFrom), HTTP/1's without CloseNotifier (as
// many middleware wrappers are), HTTP/2's (http.CloseNotifier,
// http.Pusher), or, for any other writer, mw alone (io.ReaderFrom). Every
// one is an http.Flusher and an io.StringWriter, as both of net/http's are.
func wrap(w http.ResponseWriter, mw *markWriter) http.ResponseWriter {
	_, hj := w.(http.Hijacker)
	//lint:ignore SA1019 handlers still assert it (server-sent events); it must not go missing
	_, cn := w.(http.CloseNotifier)
	_, pu := w.(http.Pusher)
	switch {
	case hj && cn:
		return http1Writer{hijackWriter{readerFromWriter{mw}}}
	case hj:
		return hijackWriter{readerFromWriter{mw}}
	case cn && pu:
		return http2Writer{mw}
	}
	return readerFromWriter{mw}
}

// readerFromWriter is a markWriter that is an io.ReaderFrom.
type readerFromWriter struct{ *markWriter }

// ReadFrom copies from src, with the underlying writer's ReadFrom when it
// has one (net/http's HTTP/1 writer uses sendfile); without a status
// written first, that is a 200.
func (w readerFromWriter) ReadFrom(src io.Reader) (int64, error) {
	w.wrote = true
	return io.Copy(w.ResponseWriter, src)
}

// hijackWriter is a markWriter that is an http.Hijacker.
type hijackWriter struct{ readerFromWriter }

// Hijack hands the connection over; nothing is marked after it.
func (w hijackWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err == nil {
		w.wrote = true
	}
	return conn, rw, err
}

// http1Writer is a markWriter over net/http's HTTP/1 writer, or one with
// its optional interfaces.
type http1Writer struct{ hijackWriter }

// CloseNotify is the underlying writer's.
func (w http1Writer) CloseNotify() <-chan bool {
	//lint:ignore SA1019 see wrap
	return w.ResponseWriter.(http.CloseNotifier).CloseNotify()
}

// http2Writer is a markWriter over net/http's HTTP/2 writer, or one with
// its optional interfaces.
type http2Writer struct{ *markWriter }

// CloseNotify is the underlying writer's.
func (w http2Writer) CloseNotify() <-chan bool {
	//lint:ignore SA1019 see wrap
	return w.ResponseWriter.(http.CloseNotifier).CloseNotify()
}

// Push is the underlying writer's.
func (w http2Writer) Push(target string, opts *http.PushOptions) error {
	return w.ResponseWriter.(http.Pusher).Push(target, opts)
}
