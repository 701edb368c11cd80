package idempotency

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
	"github.com/saferetry/saferetry/keygen"
)

// ReplayedHeader is the response header set to "true" on a replayed
// response, and only on one: the middleware removes it from a first answer.
const ReplayedHeader = "Idempotent-Replayed"

// notReplayableHeader marks a stored Response whose body was over the
// stored-body cap: its replays answer CodeResponseNotReplayable. It never
// reaches a client.
const notReplayableHeader = "Saferetry-Not-Replayable"

// pollInterval is how often a request waiting on a record in progress reads
// it (WithMaxInProgressWait).
const pollInterval = 100 * time.Millisecond

// errNilStore is the error of a Middleware made with a nil store: it
// answers 503 CodeStoreUnavailable, and its Completer's and Reaper's runs
// fail with it.
var errNilStore = errors.New("idempotency: no store (nil): unavailable")

// Middleware makes the guarded requests of the handlers it wraps take
// effect effectively once within their key scope and replay window (see the
// package doc and docs/CONTRACT.md). Its Completer and Reaper share its
// store and policy. A Middleware is safe for concurrent use.
type Middleware struct {
	cfg     config
	store   Store
	tx      Transactor // the store, when it is one
	sweeper Sweeper    // the store, when it is one: the background jobs' listings
	obs     observers  // the logging observer first
	horizon time.Duration
}

// New returns the middleware for store, configured by opts. It never fails:
// option values it cannot honour are documented by each option. A nil store
// answers every guarded request 503 CodeStoreUnavailable, and the runs of
// its Completer and Reaper fail.
func New(store Store, opts ...Option) *Middleware {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	horizon := max(cfg.horizon, addSat(cfg.replayWindow, cfg.lease))
	m := &Middleware{cfg: cfg, store: store, horizon: horizon}
	m.tx, _ = store.(Transactor)
	m.sweeper, _ = store.(Sweeper)
	if cfg.logger != nil {
		m.obs = append(m.obs, newLogObserver(cfg.logger))
	}
	m.obs = append(m.obs, cfg.observers...)
	return m
}

// Wrap returns next guarded by m. Use it as any func(http.Handler)
// http.Handler middleware: mux.Handle("POST /payments", mw.Wrap(pay)).
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return &handler{m: m, next: next}
}

type handler struct {
	m    *Middleware
	next http.Handler
}

// request is one guarded request after parsing.
type request struct {
	scope  Scope
	input  fingerprintInput
	fp     string // the fingerprint of fingerprintVersion
	execID string // the ID of the request stored by a claim that creates the record
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
	principal, err := m.cfg.principal(r)
	switch {
	case errors.Is(err, ErrPrincipalRefused):
		m.refuse(ctx, w, unscoped, http.StatusUnauthorized, CodePrincipalRefused, "", err)
		return
	case err != nil:
		m.refuse(ctx, w, unscoped, http.StatusServiceUnavailable, CodePrincipalUnavailable,
			"the server could not identify the caller; retry later with the same key", err)
		return
	}
	if principal == "" && !m.cfg.anonymous {
		// Fail closed: anonymous callers would share one namespace of keys.
		m.refuse(ctx, w, unscoped, http.StatusUnauthorized, CodePrincipalMissing,
			"a request with an idempotency key must identify its caller", nil)
		return
	}
	route := h.route(r)
	scope := Scope{Principal: principal, Method: method, Route: route, Key: key}
	body, err := readBody(r, m.cfg.maxRequestBody)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.Is(err, errTooLarge) || errors.As(err, &mbe) {
			m.refuse(r.Context(), w, scope, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
				"the body of a request with an idempotency key may not exceed "+
					strconv.FormatInt(m.cfg.maxRequestBody, 10)+" bytes", nil)
			return
		}
		m.refuse(r.Context(), w, scope, http.StatusBadRequest, CodeRequestUnreadable, "", nil)
		return
	}
	req := request{scope: scope, input: fingerprintInput{
		method: method, route: route, path: r.URL.EscapedPath(), rawQuery: r.URL.RawQuery,
		contentType: r.Header.Get("Content-Type"), body: body,
	}}
	req.fp, _ = fingerprint(req.input, fingerprintVersion)
	h.serve(w, r, req)
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

// serve claims the key and answers according to what the claim did.
func (h *handler) serve(w http.ResponseWriter, r *http.Request, req request) {
	m := h.m
	ctx := r.Context()
	if m.store == nil {
		m.refuseStore(ctx, w, req.scope, errNilStore)
		return
	}
	req.execID = rand.Text()
	claim := Claim{
		Scope:              req.scope,
		Fingerprint:        req.fp,
		FingerprintVersion: fingerprintVersion,
		Owner:              rand.Text(),
		Request: storedRequest{
			ID: req.execID, Method: req.scope.Method, URL: r.URL.RequestURI(), Host: r.Host,
			ContentType: req.input.contentType, Body: req.input.body,
		}.encode(),
		Now:          time.Now(),
		LeaseFor:     m.cfg.lease,
		ReplayWindow: m.cfg.replayWindow,
	}
	waitUntil := claim.Now.Add(m.cfg.wait)
	// The claim and the run go on when the client goes away: a claim that
	// committed while its caller gave up would leave the key in progress,
	// with nobody to finish or release it, until its lease expired.
	bg := context.WithoutCancel(ctx)
	for claims := 0; ; claims++ {
		res, err := m.claim(bg, claim)
		if err != nil {
			m.refuseStore(ctx, w, req.scope, err)
			return
		}
		if res.Acquired() {
			// The key is ours: the handler runs to its end even if the
			// client goes away, so that its response is stored and the
			// client's retry replays it instead of running the work again.
			h.run(w, r, req, res, false)
			return
		}
		rec := res.Record
		// Someone else holds or completed the key: answer from the record,
		// reading it again while it is in progress and the wait allows.
		for {
			if m.answer(ctx, w, req, rec) {
				return
			}
			now := time.Now()
			if rec.LeaseUntil.Before(now) && claims < 3 {
				break // the lease expired (LeaseUntil < now): claim again to take it over
			}
			left := waitUntil.Sub(now)
			if left <= 0 {
				m.refuse(ctx, w, req.scope, http.StatusConflict, CodeInProgress,
					"a request with this idempotency key is being processed; "+
						"retry later with the same key", nil)
				return
			}
			if wait.Sleep(ctx, min(left, pollInterval)) != nil {
				return // the client went away while it waited: nobody to answer
			}
			rec, err = m.get(ctx, req.scope)
			if ctx.Err() != nil {
				return // the client went away: not a store outage
			}
			if errors.Is(err, ErrNotFound) && claims < 3 {
				break // released: claim again
			}
			if err != nil {
				m.refuseStore(ctx, w, req.scope, err)
				return
			}
		}
		claim.Now = time.Now()
		claim.Fingerprint, claim.FingerprintVersion = req.fp, fingerprintVersion
		if rec.State == InProgress && rec.FingerprintVersion != fingerprintVersion {
			// A record of an older fingerprint version: a takeover keeps
			// its version, so the claim compares in it.
			if fp, ok := fingerprint(req.input, rec.FingerprintVersion); ok {
				claim.Fingerprint, claim.FingerprintVersion = fp, rec.FingerprintVersion
			}
		}
	}
}

// sameRequest reports whether rec was made by the request req: its
// fingerprint, in the record's version, is req's.
func sameRequest(req request, rec Record) bool {
	if rec.FingerprintVersion == fingerprintVersion {
		return rec.Fingerprint == req.fp
	}
	fp, ok := fingerprint(req.input, rec.FingerprintVersion)
	return ok && rec.Fingerprint == fp
}

// answer answers from a record the request does not own when it is
// completed or belongs to a different request, and reports whether it did.
func (m *Middleware) answer(ctx context.Context, w http.ResponseWriter, req request,
	rec Record) bool {
	switch {
	case rec.State != Absent && !sameRequest(req, rec):
		m.refuse(ctx, w, req.scope, m.cfg.mismatchStatus, CodeKeyReused,
			"this idempotency key was already used for a different request; "+
				"use a new key for a new request", nil)
		return true
	case rec.State == Completed:
		m.replay(ctx, w, req.scope, rec)
		return true
	}
	return false
}

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

// errNotSweeper is the error of the runs of a Completer or a Reaper whose
// store lists no records.
var errNotSweeper = fmt.Errorf("idempotency: the store lists no records (not a Sweeper): %w",
	errors.ErrUnsupported)

// sweeps returns nil when the background jobs can run over m's store, and
// otherwise why they cannot.
func (m *Middleware) sweeps() error {
	switch {
	case m.store == nil:
		return errNilStore
	case m.sweeper == nil:
		return errNotSweeper
	}
	return nil
}
