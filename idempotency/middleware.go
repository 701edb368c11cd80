package idempotency

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/saferetry/saferetry/internal/duelist"
	"github.com/saferetry/saferetry/keygen"
)

// notReplayableHeader marks a stored Response whose body exceeded the
// stored-body cap: the record is completed but replays answer
// CodeResponseNotReplayable. It lives in Response.Header so that every store
// keeps it without a schema change; it is never sent to a client.
const notReplayableHeader = "Saferetry-Not-Replayable"

// ReplayedHeader is the response header set to "true" on every replayed
// response.
const ReplayedHeader = "Idempotent-Replayed"

// storeTimeout bounds each store call the middleware makes after the handler
// returned (complete, release, end lease), when the client may be gone.
const storeTimeout = 10 * time.Second

// boundedCtx returns ctx bounded by storeTimeout, unless the store never
// waits. ctx must already be detached from the client (context.WithoutCancel).
func (h *handler) boundedCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	if h.mem != nil {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, storeTimeout)
}

// New returns middleware that makes the guarded requests of the handlers it
// wraps effectively once within the key scope and the replay window.
//
// A request is guarded when its method is guarded (WithMethods; default POST
// and PATCH) and it carries a key (WithKeyHeader; default Idempotency-Key,
// parsed by ParseKey). Other requests pass through untouched, except that a
// guarded method without a key gets 400 CodeKeyMissing under
// WithKeyRequired. The scope of a key is (principal, method, route, key)
// (WithPrincipal, WithRoute); its fingerprint is Fingerprint of the request.
// The answers:
//
//   - Key absent (or its completed record older than the replay window): the
//     store claims it atomically, the handler runs, and its response is
//     buffered, stored and only then sent.
//   - In progress, lease alive, same fingerprint: 409 CodeInProgress with
//     Retry-After: 1, after waiting up to WithInProgressWait for it to finish.
//   - In progress, lease expired, same fingerprint: the store hands the record
//     over with a bumped generation (fencing); the handler runs again, with
//     the previous owner's recovery point in its Run (FromContext).
//   - Completed, same fingerprint: status, allow-listed headers
//     (WithReplayHeaders) and body replayed verbatim plus Idempotent-Replayed:
//     true; 409 CodeResponseNotReplayable if the body was over the cap.
//   - Any state, different fingerprint: CodeKeyReused, 422 by default
//     (WithMismatchStatus).
//   - Malformed key: 400 CodeKeyInvalid. Body over WithMaxRequestBody: 413
//     CodeRequestTooLarge. Principal error (or an empty principal under
//     WithPrincipalRequired): 401 CodePrincipalUnavailable.
//   - Store error: 503 CodeStoreUnavailable; the handler never runs
//     unprotected (a nil store answers this way to every guarded request).
//   - The handler answered while an External call's outcome is unknown (its
//     intent recorded, no result): 503 CodeRequestIncomplete, nothing
//     stored, the record kept for a resume (see Run.External).
//
// Every answer of the middleware's own is RFC 9457 problem+json (Problem)
// with Cache-Control: no-store.
//
// Which outcomes are stored: 2xx, 3xx and 4xx responses except 408, 409, 425
// and 429; 5xx only under WithStore5xx. The others, a handler panic and a
// failure before the handler ran release the key (Store.Release), so a retry
// runs again; but when the record holds a recovery point (a phase committed),
// it is kept in progress and its lease is ended at once, so that a retry takes
// it over and resumes. A handler panic is re-raised after the release, for
// net/http to handle (it logs and drops the connection).
//
// While the handler runs the middleware heartbeats every lease/3
// (WithLease); if the store reports the lease lost, the handler's context is
// canceled with cause ErrLeaseLost. If the completion then fails with
// ErrLeaseLost (a successor took over), the late owner's response is
// discarded and its client gets the successor's stored response or 409
// CodeInProgress. If heartbeats fail for another reason (the store is
// unreachable) until less than lease/3 of the lease is left, the handler's
// context is canceled with cause ErrLeaseExpired, before the lease can run
// out under it, and no new phase may start; what it did is still completed
// when it returns (the completion is fenced: it fails with ErrLeaseLost if a
// successor took over, and stores the work, never to be repeated, if none
// did).
//
// With a store that implements Transactor, the stored response commits in
// a Unit: the request's unit, begun when the handler first asks for it
// (Run.Unit, or sqlstore.Tx for the SQL store), so that the handler's
// writes made through it and the record commit or fail together; or one
// begun at completion when the handler never asked (for the MemoryStore
// itself, whose Complete is already one fenced write under its lock, its
// Complete instead). The unit is not begun
// before the handler runs: a handler holds no transaction (on SQLite, no
// write lock) while it works, runs atomic phases (Run.Phase, Run.External)
// or calls other services. A failed Begin or commit answers 503 and sends
// nothing of the handler's response. With a store that is not a
// Transactor, a completion that fails for another reason than a lost lease
// is logged and the handler's response is still sent (the work was done);
// the record then stays in progress until its lease expires.
//
// The handler's context keeps the request's values and deadline and is
// canceled when the client goes away, but the store calls after the handler
// (complete, release) run even then. The handler sees the full request
// body. Its response writer buffers everything: Flush is deferred until the
// record is committed, 1xx responses are dropped, and hijacking is not
// supported.
//
// The returned middleware is safe for concurrent use. New never fails; bad
// option values keep their defaults (see each option).
func New(store Store, opts ...Option) func(http.Handler) http.Handler {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	tx, _ := store.(Transactor)
	// Only the MemoryStore itself: a store that embeds it (a wrapper that
	// adds I/O, say) keeps the timeout.
	mem, _ := store.(*MemoryStore)
	return func(next http.Handler) http.Handler {
		return &handler{cfg: cfg, store: store, tx: tx, mem: mem, next: next}
	}
}

type handler struct {
	cfg   config
	store Store
	tx    Transactor
	// mem is the store when it is the *MemoryStore itself: it never waits
	// (no timeouts on its calls), and the middleware hands it what it
	// builds for it (the stored request, the response) without copies.
	mem   *MemoryStore
	next  http.Handler
	beats duelist.Shards[*heartbeat] // the first heartbeat of every run
}

// request is one guarded request after parsing.
type request struct {
	scope  Scope
	fp     string
	body   []byte
	stored []byte // the encoded StoredRequest of this claim ("" for the completer's)
	execID string // its ID
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.cfg.methods[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	key, present, err := ParseKey(r.Header, h.cfg.header)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, err.Error(), nil)
		return
	}
	if !present {
		if h.cfg.required {
			writeProblem(w, http.StatusBadRequest, CodeKeyMissing,
				"this endpoint requires the "+h.cfg.header+" header", nil)
			return
		}
		h.next.ServeHTTP(w, r)
		return
	}
	principal, err := h.cfg.principal(r)
	if err != nil || (principal == "" && h.cfg.needPrincipal) {
		writeProblem(w, http.StatusUnauthorized, CodePrincipalUnavailable, "", nil)
		return
	}
	body, err := readBody(r, h.cfg.maxRequestBody)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.Is(err, errTooLarge) || errors.As(err, &mbe) {
			writeProblem(w, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
				"the body of a request with an idempotency key may not exceed "+
					strconv.FormatInt(h.cfg.maxRequestBody, 10)+" bytes", nil)
			return
		}
		writeProblem(w, http.StatusBadRequest, CodeRequestUnreadable, "", nil)
		return
	}
	route := h.cfg.route(r)
	req := request{
		scope: Scope{Principal: principal, Method: r.Method, Route: route, Key: key},
		fp:    Fingerprint(r.Method, route, r.URL.EscapedPath(), r.URL.RawQuery, r.Header.Get("Content-Type"), body),
		body:  body,
	}
	h.serve(w, r, req)
}

var errTooLarge = errors.New("idempotency: request body too large")

// bodyReader is the handler's request body: the bytes the middleware read,
// with a Close that does nothing.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

func readBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	// Sized by the declared length when there is one (one byte more, so
	// that reading the end needs no second buffer), as io.ReadAll otherwise;
	// never more than 64 KiB before the bytes arrive, whatever a client
	// declares.
	limit = min(limit, math.MaxInt64-1) // limit+1 below must not overflow
	size := int64(512)
	if n := r.ContentLength; n >= 0 && n <= limit {
		size = min(n+1, 64<<10)
	}
	b, err := readAll(r.Body, make([]byte, 0, size), limit+1)
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errTooLarge
	}
	return b, nil
}

// readAll is io.ReadAll appending to b, reading no more than limit bytes in
// all (as through an io.LimitedReader).
func readAll(r io.Reader, b []byte, limit int64) ([]byte, error) {
	for {
		if int64(len(b)) >= limit {
			return b, nil
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // let append grow the buffer
		}
		n, err := r.Read(b[len(b):min(int64(cap(b)), limit)])
		b = b[:len(b)+n]
		if err != nil {
			if err == io.EOF {
				err = nil
			}
			return b, err
		}
	}
}

func (h *handler) log(ctx context.Context, level slog.Level, msg string, s Scope, attrs ...any) {
	attrs = append(attrs, "method", s.Method, "route", s.Route, "key_digest", LogDigest(s.Key))
	h.cfg.logger.Log(ctx, level, msg, attrs...)
}

func (h *handler) storeUnavailable(w http.ResponseWriter, r *http.Request, s Scope, err error) {
	h.log(r.Context(), slog.LevelError, "idempotency: store unavailable", s, "err", err)
	writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable, "", nil)
}

// serve claims the key and answers according to the record's state.
func (h *handler) serve(w http.ResponseWriter, r *http.Request, req request) {
	if h.store == nil {
		h.storeUnavailable(w, r, req.scope, errors.New("idempotency: nil store"))
		return
	}
	ctx := r.Context()
	var owner string
	if h.cfg.newOwner != nil { // a test's
		owner, req.execID = h.cfg.newOwner(), newExecID()
	} else {
		owner, req.execID = newIDs()
	}
	req.stored = StoredRequest{
		ID:     req.execID,
		Method: r.Method, URL: r.URL.RequestURI(), Host: r.Host,
		ContentType: r.Header.Get("Content-Type"), Body: req.body,
	}.Encode()
	claim := Claim{
		Scope:              req.scope,
		Fingerprint:        req.fp,
		FingerprintVersion: FingerprintVersion,
		Owner:              owner,
		Request:            req.stored,
		Now:                h.cfg.now(),
		LeaseFor:           h.cfg.lease,
		ReplayWindow:       h.cfg.replayWindow,
	}
	waitUntil := claim.Now.Add(h.cfg.wait)
	bg := context.WithoutCancel(ctx) // store calls and the run go on when the client goes away
	for claims := 0; ; claims++ {
		// The claim runs to its end even if the client goes away: a claim
		// that committed while its caller gave up would leave the key in
		// progress, with nobody to finish or release it, until its lease
		// expired.
		rec, acquired, err := h.claim(bg, claim)
		if err != nil {
			h.storeUnavailable(w, r, req.scope, err)
			return
		}
		if acquired {
			h.run(w, r, bg, req, rec)
			return
		}
		// Someone else holds or completed the key: answer from the record,
		// polling while it is in progress and the wait allows.
		for {
			if h.answerSettled(w, req, rec) {
				return
			}
			now := h.cfg.now()
			if rec.LeaseUntil.Before(now) && claims < 3 {
				break // the lease expired (LeaseUntil < now): claim again to take it over
			}
			left := waitUntil.Sub(now)
			if left <= 0 || h.cfg.sleep(ctx, min(left, h.cfg.pollInterval)) != nil {
				writeProblem(w, http.StatusConflict, CodeInProgress,
					"a request with this idempotency key is being processed; retry later with the same key", nil)
				return
			}
			rec, err = h.store.Get(ctx, req.scope)
			if errors.Is(err, ErrNotFound) && claims < 3 {
				break // released: claim again
			}
			if err != nil {
				h.storeUnavailable(w, r, req.scope, err)
				return
			}
		}
		claim.Now = h.cfg.now()
	}
}

// claim claims c.Scope. The memory store keeps c.Request without a copy:
// it is freshly encoded for this request and never written again.
func (h *handler) claim(bg context.Context, c Claim) (Record, bool, error) {
	if h.mem != nil {
		return h.mem.claim(c, true)
	}
	ctx, cancel := h.boundedCtx(bg)
	defer cancel()
	return h.store.Claim(ctx, c)
}

// answerSettled answers a record that the caller does not own when it is
// completed or belongs to a different request, and reports whether it did.
func (h *handler) answerSettled(w http.ResponseWriter, req request, rec Record) bool {
	same := rec.Fingerprint == req.fp && rec.FingerprintVersion == FingerprintVersion
	switch {
	case !same && rec.State != Absent:
		writeProblem(w, h.cfg.mismatchStatus, CodeKeyReused,
			"this idempotency key was already used for a different request; use a new key for a new request", nil)
		return true
	case rec.State == Completed:
		h.replay(w, rec)
		return true
	}
	return false
}

func (h *handler) replay(w http.ResponseWriter, rec Record) {
	resp := rec.Response
	if resp == nil {
		h.log(context.Background(), slog.LevelError, "idempotency: completed record without a response", rec.Scope)
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable, "the stored record has no response", nil)
		return
	}
	if resp.Header.Get(notReplayableHeader) != "" {
		writeProblem(w, http.StatusConflict, CodeResponseNotReplayable,
			"the request with this idempotency key completed, but its response was too large to store; it is not executed again",
			func(p *Problem) { p.OriginalStatus = resp.Status })
		return
	}
	dst := w.Header()
	for k, v := range resp.Header {
		if k = http.CanonicalHeaderKey(k); h.cfg.replayHeaders[k] {
			dst[k] = append([]string(nil), v...)
		}
	}
	dst.Set(ReplayedHeader, "true")
	dst.Set("Content-Length", strconv.Itoa(len(resp.Body)))
	status := resp.Status
	if status < 100 || status > 999 {
		status = http.StatusInternalServerError
	}
	w.WriteHeader(status)
	_, _ = w.Write(resp.Body)
}

// outcome is how an execution ended, for the Completer's report.
type outcome int

const (
	outcomeCompleted outcome = iota // the response is stored
	outcomeReleased                 // an unstored outcome released the key
	outcomeKept                     // an unstored outcome after a recovery point: in progress, lease ended
	outcomeLost                     // the lease was lost: a successor owns the record
	outcomeFailed                   // a store failure; the record stays as it was
)

// newRun returns the Run of an execution that owns rec.
func (h *handler) newRun(bg context.Context, scope Scope, rec Record, stored []byte, execID string) *Run {
	run := &Run{
		Scope: scope, Lease: rec.Lease(),
		RecoveryPoint: rec.RecoveryPoint, RecoveryData: rec.RecoveryData,
		store: h.store, tx: h.tx, bg: bg, now: h.cfg.now, leaseFor: h.cfg.lease,
		leaseUntil: rec.LeaseUntil, point: rec.RecoveryPoint, created: rec.CreatedAt,
	}
	if execID != "" && bytes.Equal(rec.Request, stored) {
		run.execID = execID // the record holds the request this claim stored
	} else if sr, err := DecodeRequest(rec.Request); err == nil {
		run.execID = sr.ID // a takeover: the first execution's identity
	}
	return run
}

// run executes the handler as the owner of rec and answers through w.
// bg is r's context without its cancellation: store calls keep going when
// the client disconnects.
func (h *handler) run(w http.ResponseWriter, r *http.Request, bg context.Context, req request, rec Record) outcome {
	lease := rec.Lease()
	run := h.newRun(bg, req.scope, rec, req.stored, req.execID)
	// The handler's context: the request's values, deadline and
	// cancellation, and cancellation with cause ErrLeaseLost. No unit of
	// work is open yet: Run.Unit (or sqlstore.Tx) begins the request's unit
	// when the handler first asks for it, else the completion begins one.
	// Derived from the request's own context, hctx gets its deadline and
	// its cancellation (with its cause) from its parent.
	hctx, cancel := context.WithCancelCause(withRun(r.Context(), run))
	defer cancel(nil)
	run.cancel = cancel

	hb := h.heartbeat(bg, run, cancel)
	// The capture and the handler's body live in the Run (as do the
	// heartbeat and the context value): one allocation for all. The
	// handler's request is not, so that a context of the handler's that
	// outlives the request (it holds the Run) does not keep the request's
	// headers and parsed form alive.
	run.cw = capture{w: w, header: make(http.Header)}
	cw := &run.cw
	r2 := r.WithContext(hctx)
	run.body.Reset(req.body)
	r2.Body = &run.body
	r2.ContentLength = int64(len(req.body))

	normal := false
	defer func() {
		if normal {
			return
		}
		// The handler panicked (or called runtime.Goexit): give the key up
		// (or keep it for a resume after a committed phase) and let the
		// panic continue to net/http.
		hb.stop()
		if unit, _ := run.close(); unit != nil {
			_ = unit.Rollback()
		}
		h.log(bg, slog.LevelWarn, "idempotency: handler panicked; giving up the key", req.scope,
			"recovery_point", run.currentPoint())
		h.abort(bg, lease, run.currentPoint())
	}()
	h.next.ServeHTTP(cw, r2)
	normal = true
	hb.stop()
	out := h.finish(bg, w, r, req, run, cw)
	// The Run stays reachable from the handler's context, which may outlive
	// the request: let go of the writer and the request body. (The
	// captured body's bytes are the stored response's.)
	run.cw.w, run.cw.header = nil, nil
	run.body.Reset(nil)
	return out
}

// replayable reports whether every header of hdr is stored as it is: on
// the replay allow-list under its canonical name.
func (h *handler) replayable(hdr http.Header) bool {
	for k := range hdr {
		if !h.cfg.replayHeaders[k] { // its keys are canonical names
			return false
		}
	}
	return true
}

// stores reports whether a response with this status is stored.
func (h *handler) stores(status int) bool {
	switch {
	case status == http.StatusRequestTimeout, status == http.StatusConflict,
		status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return false
	case status >= 500:
		return h.cfg.store5xx
	}
	return true
}

func (h *handler) finish(bg context.Context, w http.ResponseWriter, r *http.Request, req request,
	run *Run, cw *capture) outcome {
	lease := run.Lease
	unit, unitErr := run.close()
	if unitErr != nil {
		// The handler asked for its unit and the store could not begin it:
		// whatever the handler answered, nothing of its unit committed.
		return h.unavailable(bg, w, r, req, run, unitErr)
	}
	// A run whose heartbeats failed until its lease was about to end had its
	// context canceled (so that it starts nothing new), but what it did is
	// still completed below: the completion is fenced on owner and
	// generation, so it fails with ErrLeaseLost if a successor took over and
	// stores the work (never to be repeated) if none did.
	status := cw.statusCode()
	if !h.stores(status) {
		if unit != nil {
			_ = unit.Rollback()
		}
		cw.release()
		if h.abort(bg, lease, run.currentPoint()) {
			return outcomeKept
		}
		return outcomeReleased
	}
	if point := run.currentPoint(); strings.HasPrefix(point, intentPrefix) {
		// An External call's outcome is unknown: storing this answer would
		// replay it for whatever the call did. Keep the record for a
		// resume that asks lookup first.
		if unit != nil {
			_ = unit.Rollback()
		}
		h.log(bg, slog.LevelError, "idempotency: the handler answered while an external call's outcome is unknown; "+
			"its response is not stored and the record is kept for a resume", req.scope,
			"status", status, "recovery_point", point, "generation", lease.Generation)
		h.abort(bg, lease, point)
		writeProblem(w, http.StatusServiceUnavailable, CodeRequestIncomplete,
			"a call to another service made for this request has an unknown outcome; retry with the same key to finish it", nil)
		return outcomeKept
	}
	resp := Response{Status: status}
	tooLarge := cw.body.Len() > h.cfg.maxStoredBody
	if !tooLarge && h.mem != nil && h.replayable(cw.header) {
		// Every header is replayed as it is, and the memory store keeps
		// copies of its strings, never the map or its slices: no copy
		// of its own is needed. (Another store may keep what it gets.)
		resp.Header = cw.header
	} else {
		resp.Header = make(http.Header, len(cw.header))
		for k, v := range cw.header {
			if k = http.CanonicalHeaderKey(k); h.cfg.replayHeaders[k] {
				resp.Header[k] = append([]string(nil), v...)
			}
		}
	}
	if tooLarge {
		resp.Header.Set(notReplayableHeader, "body-too-large")
		h.log(bg, slog.LevelWarn, "idempotency: response body over the stored-body cap; replays will answer "+CodeResponseNotReplayable,
			req.scope, "bytes", cw.body.Len(), "cap", h.cfg.maxStoredBody)
	} else {
		resp.Body = cw.body.Bytes()
	}

	ctx, cancel := h.boundedCtx(bg)
	defer cancel()
	if unit == nil && h.tx != nil && h.mem == nil {
		// The handler never asked for its unit: complete in one now.
		// (The memory store's Complete is that unit already: one write
		// under its lock, conditional on the lease.)
		u, _, err := h.tx.Begin(bg, lease)
		if err != nil {
			return h.unavailable(bg, w, r, req, run, err)
		}
		unit = u
	}
	now := h.cfg.now()
	var err error
	if unit == nil && h.mem != nil {
		// resp is never touched again (the capture only reads it when it
		// releases the response): the store may keep it.
		err = h.mem.completeOwned(lease, &resp, now)
	} else if unit != nil {
		if oc, ok := unit.(ownedCompleter); ok {
			// resp is never touched again (the capture only reads its
			// body when it releases the response): the unit may keep it.
			err = oc.completeOwned(&resp, now)
		} else {
			err = unit.Complete(ctx, resp, now)
		}
		if err == nil {
			err = unit.Commit()
		}
		if err != nil {
			_ = unit.Rollback()
		}
	} else {
		err = h.store.Complete(ctx, lease, resp, now)
	}
	switch {
	case err == nil:
		cw.release()
		return outcomeCompleted
	case errors.Is(err, ErrLeaseLost):
		h.log(bg, slog.LevelWarn, "idempotency: lease lost before completion; the response is discarded", req.scope,
			"generation", lease.Generation)
		h.answerLost(ctx, w, req)
		return outcomeLost
	case unit != nil:
		// Nothing of the handler's unit committed.
		return h.unavailable(bg, w, r, req, run, err)
	default:
		h.log(bg, slog.LevelError, "idempotency: storing the response failed; sending it unstored", req.scope, "err", err)
		cw.release()
		return outcomeFailed
	}
}

// unavailable answers 503 after the store failed to begin or commit the
// request's unit, and gives the key up (or keeps it for a resume).
func (h *handler) unavailable(bg context.Context, w http.ResponseWriter, r *http.Request, req request, run *Run, err error) outcome {
	h.abort(bg, run.Lease, run.currentPoint())
	h.storeUnavailable(w, r, req.scope, err)
	return outcomeFailed
}

// answerLost answers the client of an execution that lost its lease: the
// successor's stored response if it completed, else 409 in progress.
func (h *handler) answerLost(ctx context.Context, w http.ResponseWriter, req request) {
	rec, err := h.store.Get(ctx, req.scope)
	if err == nil && rec.State == Completed && h.answerSettled(w, req, rec) {
		return
	}
	writeProblem(w, http.StatusConflict, CodeInProgress,
		"another execution took over this idempotency key; retry later with the same key", nil)
}

// abort gives the key up after an unstored outcome: Release, unless the
// record holds a recovery point, in which case the lease is ended at once
// so that a retry takes the record over and resumes.
//
// It reports whether the record was kept.
func (h *handler) abort(bg context.Context, lease Lease, recoveryPoint string) bool {
	ctx, cancel := h.boundedCtx(bg)
	defer cancel()
	keep := recoveryPoint != ""
	if !keep {
		rec, err := h.store.Get(ctx, lease.Scope)
		switch {
		case errors.Is(err, ErrNotFound):
			return false
		case err != nil:
			keep = true // cannot tell: ending the lease is safe either way
		case rec.State != InProgress || rec.Owner != lease.Owner || rec.Generation != lease.Generation:
			return false // no longer ours
		default:
			keep = rec.RecoveryPoint != ""
		}
	}
	var err error
	if keep {
		err = h.store.Heartbeat(ctx, lease, h.cfg.now())
	} else {
		err = h.store.Release(ctx, lease)
	}
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		h.log(bg, slog.LevelError, "idempotency: giving up the key failed; it stays claimed until its lease expires",
			lease.Scope, "err", err, "release", !keep)
	}
	return keep
}

// heartbeat extends a lease every lease/3 while the handler runs. It is a
// timer, not a goroutine: nothing runs between beats, and stop does not wait
// unless a beat is in flight. It lives in its Run. Its first beat is timed
// by its handler's lists of first beats (package duelist: most requests end
// before it, and a runtime timer each would cost two allocations); a
// handler that outlives it gets a timer of its own for the next ones, and
// a run the lists refuse (see duelist.List.Add) gets one at once.
type heartbeat struct {
	h      *handler
	run    *Run
	bg     context.Context
	cancel context.CancelCauseFunc
	first  duelist.Node[*heartbeat]

	mu      sync.Mutex
	timer   *time.Timer // nil until a beat needs one of its own
	stopped bool
}

// stop ends the heartbeat: no beat starts after it, and a beat still in
// flight (say, on SQLite, waiting for the write lock that the request's own
// unit holds until finish commits it) has no effect when it returns. stop
// does not wait for it: waiting could stall the request for the store's busy
// timeout behind its own lock.
func (hb *heartbeat) stop() {
	hb.mu.Lock()
	hb.stopped = true
	if hb.timer != nil {
		hb.timer.Stop()
	}
	hb.mu.Unlock()
	hb.first.Remove()
}

// heartbeat extends the lease every lease/3 until stopped; a lost lease
// cancels the handler's context with cause ErrLeaseLost, and failures that
// last until less than lease/3 of the lease is left cancel it with cause
// ErrLeaseExpired (and mark the run expired).
func (h *handler) heartbeat(bg context.Context, run *Run, cancel context.CancelCauseFunc) *heartbeat {
	hb := &run.hb // part of the Run: no allocation of its own
	hb.h, hb.run, hb.bg, hb.cancel = h, run, bg, cancel
	interval := h.cfg.lease / 3
	if now := time.Now(); !h.beats.Add(&hb.first, hb, now.Add(interval), now) {
		hb.mu.Lock()
		hb.timer = time.AfterFunc(interval, hb.beat)
		hb.mu.Unlock()
	}
	return hb
}

// Expire starts the first beat when its time has come, in a goroutine of its
// own (a beat waits for the store, and one slow beat must not hold up the
// others): the handler's lists of first beats call it.
func (hb *heartbeat) Expire() { go hb.beat() }

// beat is one heartbeat, run by the timer.
func (hb *heartbeat) beat() {
	h, run, bg := hb.h, hb.run, hb.bg
	lease := run.Lease
	interval := h.cfg.lease / 3
	margin := h.cfg.lease / 3
	hb.mu.Lock()
	stopped := hb.stopped
	hb.mu.Unlock()
	if stopped {
		return
	}
	start := h.cfg.now()
	// Half the margin: a beat that hangs gives up while the lease
	// still has time left for the next one.
	ctx, c := context.WithTimeout(bg, margin/2)
	until := start.Add(h.cfg.lease)
	err := h.store.Heartbeat(ctx, lease, until)
	c()
	hb.mu.Lock()
	stopped = hb.stopped
	hb.mu.Unlock()
	if stopped {
		return // the handler is done: this late beat changes nothing
	}
	if err == nil {
		run.extend(until)
	}
	if errors.Is(err, ErrLeaseLost) {
		h.log(bg, slog.LevelWarn, "idempotency: lease lost while the handler ran; canceling it", lease.Scope,
			"generation", lease.Generation)
		hb.cancel(ErrLeaseLost)
		return
	}
	if err != nil && run.expiring(h.cfg.now(), margin) {
		h.log(bg, slog.LevelError, "idempotency: heartbeats failed and the lease is about to run out; canceling the handler (its work is completed only if no successor took over)",
			lease.Scope, "err", err, "generation", lease.Generation)
		hb.cancel(ErrLeaseExpired)
		return
	}
	if err != nil {
		h.log(bg, slog.LevelWarn, "idempotency: heartbeat failed", lease.Scope, "err", err)
	}
	// Fixed rate from the beat's start, so that a slow beat does not
	// eat into the margin; never a busy loop on a slow store.
	next := max(interval-h.cfg.now().Sub(start), interval/10)
	hb.mu.Lock()
	switch {
	case hb.stopped:
	case hb.timer == nil:
		hb.timer = time.AfterFunc(next, hb.beat)
	default:
		hb.timer.Reset(next)
	}
	hb.mu.Unlock()
}

// LogDigest returns the short digest under which the middleware, the
// Completer and the Reaper name keys, principals and downstream keys in
// their logs: the first 6 bytes of the SHA-256 of s, in hex (12
// characters). Logs never carry the raw values: a key and a downstream key
// (which contains it) are what a caller presents to get a stored response,
// and a principal may be personal data. To find the record behind a log
// line, match its method, route and times (created_at, lease_until) in the
// store, or compare LogDigest of candidate keys; a Reaper's Report and a
// program's own store queries carry the full records. Safe for concurrent
// use.
// It is keygen.Digest, so the Transport's key_digest matches the server's.
func LogDigest(s string) string { return keygen.Digest(s) }
