package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"time"

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

// storeTimeout bounds each store call of the middleware's that runs on a
// context detached from the client (the claim; after the handler: begin,
// complete, release, end lease), on every store alike.
const storeTimeout = 10 * time.Second

// boundedCtx returns ctx bounded by storeTimeout. ctx must already be
// detached from the client (context.WithoutCancel).
func boundedCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, storeTimeout)
}

// New returns middleware that makes the guarded requests of the handlers it
// wraps effectively once within the key scope and the replay window.
//
// A request is guarded when its method is guarded (WithMethods; default POST
// and PATCH) and it carries a key (WithKeyHeader; default Idempotency-Key,
// parsed by keygen.ParseHeader). Other requests pass through untouched, except that a
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
//   - Malformed key: 400 CodeKeyInvalid. No principal (by default: no
//     Authorization header): 401 CodePrincipalMissing, unless
//     WithAnonymousKeys. Principal error: 401 CodePrincipalUnavailable. Body
//     over WithMaxRequestBody: 413 CodeRequestTooLarge.
//   - Store error: 503 CodeStoreUnavailable; the handler never runs
//     unprotected (a nil store answers this way to every guarded request).
//   - The handler answered while an External call's outcome is unknown (its
//     intent recorded, no result): 503 CodeRequestIncomplete whatever the
//     handler answered (nothing of its response is sent), nothing stored,
//     the record kept for a resume (see Run.External).
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
// With a store that implements Transactor (the MemoryStore and the SQL
// store do), a handler can ask for its request's Unit (Run.Unit, or
// sqlstore.Tx for the SQL store): the stored response then commits in that
// unit, so that the handler's writes made through it and the record commit
// or fail together, and a failed commit answers 503 and sends nothing of the
// handler's response. The unit is begun only when the handler first asks:
// a handler holds no transaction (on SQLite, no write lock) while it works,
// runs atomic phases (Run.Phase, Run.External) or calls other services. A
// handler that never asked is completed with Store.Complete, one fenced
// write without a transaction; if that fails for another reason than a lost
// lease, the failure is logged and the handler's response is still sent
// (the work was done), and the record stays in progress until its lease
// expires.
// The claim and every store call after the handler returned are bounded by
// 10 seconds.
//
// The handler's context keeps the request's values and deadline (its own,
// or the one deadline.Middleware set from the client's propagated time), but
// once the key is claimed it is not canceled when the client goes away: the
// work runs to its end, its response is stored, and the client's retry gets
// the replay instead of running the work a second time (a handler that
// writes through a transaction bound to its context would otherwise fail
// with "context canceled", release the key, and run again on the retry).
// It ends only when the deadline passes, the lease is lost (cause
// ErrLeaseLost or ErrLeaseExpired, above), or the server shuts down: with
// WithShutdown(ctx), when ctx ends (cause context.Cause(ctx)). Without
// WithShutdown, http.Server.Shutdown waits for such handlers as for any
// other, and http.Server.Close does not stop them. The handler sees the
// full request body. Its response writer buffers everything: Flush is deferred until the
// record is committed, 1xx responses are dropped, and hijacking fails with
// ErrHijackGuarded (what the handler then answers is handled as any answer).
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
	return func(next http.Handler) http.Handler {
		return &handler{cfg: cfg, store: store, tx: tx, next: next}
	}
}

type handler struct {
	cfg   config
	store Store
	tx    Transactor // the store, when it is a Transactor
	next  http.Handler
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
	vals := r.Header.Values(h.cfg.header)
	if len(vals) == 0 {
		if h.cfg.required {
			writeProblem(w, http.StatusBadRequest, CodeKeyMissing,
				"this endpoint requires the "+h.cfg.header+" header", nil)
			return
		}
		h.next.ServeHTTP(w, r)
		return
	}
	key, err := keygen.ParseHeader(vals)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, h.cfg.header+": "+err.Error(), nil)
		return
	}
	principal, err := h.cfg.principal(r)
	if err != nil {
		writeProblem(w, http.StatusUnauthorized, CodePrincipalUnavailable, "", nil)
		return
	}
	if principal == "" && !h.cfg.anonymous {
		// Fail closed: anonymous callers would share one namespace of keys.
		writeProblem(w, http.StatusUnauthorized, CodePrincipalMissing,
			"a request with an idempotency key must identify its caller", nil)
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

func (h *handler) log(ctx context.Context, level slog.Level, msg string, s Scope, attrs ...any) {
	attrs = append(attrs, "method", s.Method, "route", s.Route, "key_digest", keygen.Digest(s.Key))
	h.cfg.logger.Log(ctx, level, msg, attrs...)
}

func (h *handler) storeUnavailable(ctx context.Context, w http.ResponseWriter, s Scope, err error) {
	h.log(ctx, slog.LevelError, "idempotency: store unavailable", s, "err", err)
	if errors.Is(err, ErrStoreFull) {
		w.Header().Set("Retry-After", "1") // fail closed until records expire or are released
	}
	writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable, "", nil)
}

// serve claims the key and answers according to the record's state.
func (h *handler) serve(w http.ResponseWriter, r *http.Request, req request) {
	if h.store == nil {
		h.storeUnavailable(r.Context(), w, req.scope, errors.New("idempotency: nil store"))
		return
	}
	ctx := r.Context()
	owner := h.cfg.newOwner()
	req.execID = newExecID()
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
		res, err := h.claim(bg, claim)
		if errors.Is(err, ErrRecordTooLarge) {
			writeProblem(w, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
				"this request is too large for the server's idempotency store", nil)
			return
		}
		if err != nil {
			h.storeUnavailable(ctx, w, req.scope, err)
			return
		}
		rec := res.Record
		if res.Acquired() {
			if f := h.cfg.obs.Claimed; f != nil {
				f(ctx, Event{Scope: req.scope, Generation: rec.Generation, Takeover: res.Outcome == ClaimTakenOver})
			}
			// The key is ours: the handler runs to its end even if the
			// client goes away (detach), so that its response is stored
			// and the client's retry replays it instead of running the
			// work again.
			hctx, cancel := detach(ctx, bg)
			defer cancel() // also when the handler panics
			h.run(w, r, bg, hctx, req, res)
			return
		}
		// Someone else holds or completed the key: answer from the record,
		// polling while it is in progress and the wait allows.
		for {
			if h.answerSettled(ctx, w, req.fp, rec) {
				return
			}
			now := h.cfg.now()
			if rec.LeaseUntil.Before(now) && claims < 3 {
				break // the lease expired (LeaseUntil < now): claim again to take it over
			}
			left := waitUntil.Sub(now)
			if left > 0 && h.cfg.sleep(ctx, min(left, h.cfg.pollInterval)) != nil {
				return // the client went away while it waited: nobody to answer
			}
			if left <= 0 {
				observe(h.cfg.obs.Conflict, ctx, Event{Scope: req.scope, Status: http.StatusConflict, Code: CodeInProgress})
				writeProblem(w, http.StatusConflict, CodeInProgress,
					"a request with this idempotency key is being processed; retry later with the same key", nil)
				return
			}
			start := time.Now()
			rec, err = h.store.Get(ctx, req.scope)
			if ctx.Err() != nil {
				return // the client went away: not a store outage
			}
			h.storeCall(ctx, OpGet, req.scope, start, err)
			if errors.Is(err, ErrNotFound) && claims < 3 {
				break // released: claim again
			}
			if err != nil {
				h.storeUnavailable(ctx, w, req.scope, err)
				return
			}
		}
		claim.Now = h.cfg.now()
	}
}

// claim claims c.Scope, bounded by storeTimeout.
func (h *handler) claim(bg context.Context, c Claim) (ClaimResult, error) {
	ctx, cancel := boundedCtx(bg)
	defer cancel()
	start := time.Now()
	res, err := h.store.Claim(ctx, c)
	h.storeCall(bg, OpClaim, c.Scope, start, err)
	return res, err
}

// answerSettled answers a record that the caller does not own when it is
// completed or belongs to a different request, and reports whether it did.
func (h *handler) answerSettled(ctx context.Context, w http.ResponseWriter, fp string, rec Record) bool {
	same := rec.Fingerprint == fp && rec.FingerprintVersion == FingerprintVersion
	switch {
	case !same && rec.State != Absent:
		observe(h.cfg.obs.Conflict, ctx, Event{Scope: rec.Scope, Status: h.cfg.mismatchStatus, Code: CodeKeyReused})
		writeProblem(w, h.cfg.mismatchStatus, CodeKeyReused,
			"this idempotency key was already used for a different request; use a new key for a new request", nil)
		return true
	case rec.State == Completed:
		h.replay(ctx, w, rec)
		return true
	}
	return false
}

func (h *handler) replay(ctx context.Context, w http.ResponseWriter, rec Record) {
	resp := rec.Response
	if resp == nil {
		h.log(context.Background(), slog.LevelError, "idempotency: completed record without a response", rec.Scope)
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreUnavailable, "the stored record has no response", nil)
		return
	}
	if resp.Header.Get(notReplayableHeader) != "" {
		observe(h.cfg.obs.Conflict, ctx, Event{Scope: rec.Scope, Status: http.StatusConflict, Code: CodeResponseNotReplayable})
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
	observe(h.cfg.obs.Replayed, ctx, Event{Scope: rec.Scope, Status: status})
	w.WriteHeader(status)
	_, _ = w.Write(resp.Body)
}
