package idempotency

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/saferetry/saferetry/keygen"
)

// ReplayedHeader is the response header set to "true" on a replayed
// response, and only on one: the middleware removes it from a first answer.
const ReplayedHeader = "Idempotent-Replayed"

// Wrap returns next guarded by m: the HTTP door. Use it as any
// func(http.Handler) http.Handler middleware: mux.Handle("POST /payments",
// mw.Wrap(pay)).
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return &handler{m: m, next: next}
}

// handler is the HTTP door: it owns the key header, the principal taken
// from the request, the request's fingerprint, the capture of the response
// and the problem answers; the core owns the rest.
type handler struct {
	m    *Middleware
	next http.Handler
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m := h.m
	method := strings.ToUpper(r.Method)
	if !m.cfg.methods[method] {
		h.next.ServeHTTP(w, r)
		return
	}
	ctx, unscoped := r.Context(), Scope{Method: method} // the refusals before a scope
	vals := r.Header.Values(m.cfg.header)
	if len(vals) == 0 {
		if m.cfg.required {
			m.refuse(ctx, w, unscoped, http.StatusBadRequest, CodeKeyMissing,
				"this endpoint requires the "+m.cfg.header+" header", nil)
			return
		}
		h.next.ServeHTTP(w, r)
		return
	}
	key, err := keygen.ParseHeader(vals)
	if err != nil {
		m.refuse(ctx, w, unscoped, http.StatusBadRequest, CodeKeyInvalid,
			m.cfg.header+": "+err.Error(), nil)
		return
	}
	principal, ok := m.principalOf(w, r, unscoped)
	if !ok {
		return
	}
	route := h.route(r)
	scope := Scope{Principal: principal, Method: method, Route: route, Key: key}
	body, err := readBody(r, m.cfg.maxRequestBody)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.Is(err, errTooLarge) || errors.As(err, &mbe) {
			m.refuse(ctx, w, scope, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
				"the body of a request with an idempotency key may not exceed "+
					strconv.FormatInt(m.cfg.maxRequestBody, 10)+" bytes", nil)
			return
		}
		m.refuse(ctx, w, scope, http.StatusBadRequest, CodeRequestUnreadable, "", nil)
		return
	}
	ct := r.Header.Get("Content-Type")
	req := newRequest(ctx, scope, fingerprintInput{
		method: method, route: route, path: r.URL.EscapedPath(), rawQuery: r.URL.RawQuery,
		contentType: ct, body: body,
	}, storedRequest{Method: method, URL: r.URL.RequestURI(), Host: r.Host, ContentType: ct,
		Body: body})
	h.serve(w, r, req)
}

// principalOf returns the principal of r, the first part of its scope
// (WithPrincipal), or answers r with the refusal (s: what is known of the
// scope) and reports false.
func (m *Middleware) principalOf(w http.ResponseWriter, r *http.Request, s Scope) (string,
	bool) {
	ctx := r.Context()
	principal, err := m.cfg.principal(r)
	switch {
	case errors.Is(err, ErrPrincipalRefused):
		m.refuse(ctx, w, s, http.StatusUnauthorized, CodePrincipalRefused, "", err)
		return "", false
	case err != nil:
		m.refuse(ctx, w, s, http.StatusServiceUnavailable, CodePrincipalUnavailable,
			"the server could not identify the caller; retry later with the same key", err)
		return "", false
	case principal == "" && !m.cfg.anonymous:
		// Fail closed: anonymous callers would share one namespace of keys.
		m.refuse(ctx, w, s, http.StatusUnauthorized, CodePrincipalMissing,
			"a request with an idempotency key must identify its caller", nil)
		return "", false
	}
	return principal, true
}

// route names r's route in its scope (WithRoute).
func (h *handler) route(r *http.Request) string {
	if h.m.cfg.route != nil {
		return h.m.cfg.route(r)
	}
	if p := r.Pattern; p != "" && !strings.HasSuffix(p, "/") && !strings.HasSuffix(p, "...}") {
		return p
	}
	if mux, ok := h.next.(*http.ServeMux); ok {
		if _, p := mux.Handler(r); p != "" {
			return p
		}
	}
	return r.URL.Path
}

// serve claims the key and answers according to what the claim decided.
func (h *handler) serve(w http.ResponseWriter, r *http.Request, req request) {
	m := h.m
	c := m.claim(req)
	switch {
	case c.gone:
		// The request's context ended while it waited on a key in progress:
		// its client went away, and reads nothing, or a deadline in front
		// of the middleware cut the wait, and the client must not read
		// net/http's empty 200 as a success.
		m.answer(req.ctx, w, req.scope, verdictBusy, c.res.Record)
	case c.err != nil:
		m.refuseStore(req.ctx, w, req.scope, c.err)
	case c.verdict == verdictRun && m.accepts():
		h.runAccepting(w, r, req, c.res)
	case c.verdict == verdictRun:
		// The key is ours: the handler runs to its end even if the client
		// goes away, so that its response is stored and the client's retry
		// replays it instead of running the work again.
		h.run(w, r, req, c.res, false)
	default:
		m.answer(req.ctx, w, req.scope, c.verdict, c.res.Record)
	}
}

// answer answers from a record the request does not own, as v says:
// replay, reused key, or in progress.
func (m *Middleware) answer(ctx context.Context, w http.ResponseWriter, s Scope, v verdict,
	rec Record) {
	switch v {
	case verdictReused:
		m.refuse(ctx, w, s, m.cfg.mismatchStatus, CodeKeyReused,
			"this idempotency key was already used for a different request; "+
				"use a new key for a new request", nil)
	case verdictReplay:
		m.replay(ctx, w, s, rec)
	default:
		m.locate(w.Header(), s, rec)
		m.refuse(ctx, w, s, http.StatusConflict, CodeInProgress,
			"a request with this idempotency key is being processed; "+
				"retry later with the same key", nil)
	}
}

// run executes the handler as the owner of res.Record (background: the
// Completer's resume, whose handler stops with r's context) and answers
// through w; it returns the outcome (see Observer.Executed).
func (h *handler) run(w http.ResponseWriter, r *http.Request, req request, res ClaimResult,
	background bool) Outcome {
	cw := &capture{w: w, header: make(http.Header)}
	e, s := h.exec(cw, r, req, res, background)
	h.respond(cw, req, s)
	return s.outcome(e)
}

// exec executes the handler as the owner of res.Record, its response
// captured in cw, and settles the record.
func (h *handler) exec(cw *capture, r *http.Request, req request, res ClaimResult,
	background bool) (ending, settled) {
	return h.m.execute(req, res, background, !background, func(ctx context.Context,
		_ *Run) ending {
		r2 := r.WithContext(ctx)
		r2.Body = io.NopCloser(bytes.NewReader(req.input.body))
		r2.ContentLength = int64(len(req.input.body))
		h.next.ServeHTTP(cw, r2)
		return h.ending(cw, background)
	})
}

// respond answers the request through cw.w after the execution settled as
// s says: the handler's response, or a problem when it cannot stand.
func (h *handler) respond(cw *capture, req request, s settled) {
	m := h.m
	switch {
	case s.lost():
		if s.recErr == nil && s.rec.State == Completed {
			v := verdictReplay // a successor's answer
			if !sameRequest(req, s.rec) {
				v = verdictReused
			}
			m.answer(req.bg, cw.w, req.scope, v, s.rec)
			break
		}
		if s.recErr == nil && s.rec.State == InProgress {
			m.locate(cw.w.Header(), req.scope, s.rec)
		}
		writeProblem(cw.w, http.StatusConflict, CodeInProgress,
			"another execution took over this idempotency key; retry later with the same key", 0)
	case s.undone:
		writeProblem(cw.w, http.StatusServiceUnavailable, CodeStoreUnavailable, "", 0)
	case s.err == nil && s.incomplete:
		// Sending its answer (a 409, a 500) would make the client give up
		// while the call may have gone through.
		writeProblem(cw.w, http.StatusServiceUnavailable, CodeRequestIncomplete,
			"a call to another service made for this request has an unknown outcome; "+
				"retry with the same key to finish it", 0)
	default:
		cw.release() // stored, not stored, or done and not undoable: send it
	}
}

// ending is what the handler's answer, captured in cw, comes to: the
// response to store, if its status is stored (a resumed request refused
// for want of credentials never is).
func (h *handler) ending(cw *capture, background bool) ending {
	status := cw.statusCode()
	e := ending{status: status}
	// A resumed request carries no credentials: a refusal is the resume's,
	// not the client's. The client's retry, which has them, takes over.
	e.needsCredentials = background &&
		(status == http.StatusUnauthorized || status == http.StatusForbidden)
	if e.needsCredentials || !h.m.stores(status) {
		return e
	}
	resp := Response{Status: status, Header: make(http.Header, len(cw.header))}
	for k, v := range cw.header {
		if k = http.CanonicalHeaderKey(k); h.m.cfg.replayHeaders[k] {
			resp.Header[k] = v // the store copies what it keeps
		}
	}
	if int64(cw.body.Len()) > h.m.cfg.maxStoredBody {
		resp.Header.Set(notReplayableHeader, "body-too-large")
	} else {
		resp.Body = cw.body.Bytes() // bytes once written are never changed (see capture)
	}
	e.resp = &resp
	return e
}

// stores reports whether a response with this status is stored.
func (m *Middleware) stores(status int) bool {
	switch {
	case status == http.StatusRequestTimeout, status == http.StatusConflict,
		status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return false
	case status >= 500:
		return m.cfg.store5xx
	}
	return true
}

// refuse answers with a problem of the middleware's own, before any handler
// ran, and reports it.
func (m *Middleware) refuse(ctx context.Context, w http.ResponseWriter, s Scope, status int,
	code Code, detail string, err error) {
	m.obs.refused(ctx, Event{Scope: s, Status: status, Code: code, Err: err})
	writeProblem(w, status, code, detail, 0)
}

// refuseStore answers a claim or a read that the store failed: 413 for a
// record it can never hold, 503 CodeStoreFull when it is full, else 503
// CodeStoreUnavailable.
func (m *Middleware) refuseStore(ctx context.Context, w http.ResponseWriter, s Scope, err error) {
	switch {
	case errors.Is(err, ErrRecordTooLarge):
		m.refuse(ctx, w, s, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
			"this request is too large for the server's idempotency store", err)
	case errors.Is(err, ErrStoreFull):
		m.refuse(ctx, w, s, http.StatusServiceUnavailable, CodeStoreFull,
			"the server holds as many idempotency records as it can; "+
				"retry later with the same key", err)
	default:
		m.refuse(ctx, w, s, http.StatusServiceUnavailable, CodeStoreUnavailable, "", err)
	}
}

// replay answers with rec's stored response.
func (m *Middleware) replay(ctx context.Context, w http.ResponseWriter, s Scope, rec Record) {
	resp := rec.Response
	switch {
	case resp == nil:
		m.refuse(ctx, w, s, http.StatusServiceUnavailable, CodeStoreUnavailable,
			"the stored record has no response",
			errors.New("idempotency: a completed record without a response"))
		return
	case resp.Header.Get(notReplayableHeader) != "":
		m.obs.refused(ctx, Event{Scope: s, Status: http.StatusConflict,
			Code: CodeResponseNotReplayable})
		writeProblem(w, http.StatusConflict, CodeResponseNotReplayable,
			"the request with this idempotency key completed, but its response was too large "+
				"to store; it is not executed again", resp.Status)
		return
	}
	dst := w.Header()
	for k, v := range resp.Header {
		if k = http.CanonicalHeaderKey(k); m.cfg.replayHeaders[k] {
			dst[k] = append([]string(nil), v...)
		}
	}
	dst.Set(ReplayedHeader, "true")
	dst.Set("Content-Length", strconv.Itoa(len(resp.Body)))
	status := resp.Status
	if status < 100 || status > 999 {
		status = http.StatusInternalServerError
	}
	m.obs.replayed(ctx, Event{Scope: s, Status: status})
	w.WriteHeader(status)
	_, _ = w.Write(resp.Body)
}
