package idempotency

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"
)

// outcome is how an execution ended, for the Completer's report.
type outcome int

const (
	outcomeCompleted outcome = iota // the response is stored
	outcomeReleased                 // an unstored outcome released the key
	outcomeKept                     // an unstored outcome after a recovery point: in progress, lease ended
	outcomeLost                     // the lease was lost: a successor owns the record
	outcomeFailed                   // a store failure; the record stays as it was
)

// newRun returns the Run of an execution that created or took over
// res.Record. A takeover keeps the first execution's identity (the ID of
// the request stored in the record); a new record has execID.
func (h *handler) newRun(bg context.Context, scope Scope, res ClaimResult, execID string) *Run {
	rec := res.Record
	run := &Run{
		Scope: scope, Lease: rec.Lease(),
		RecoveryPoint: rec.RecoveryPoint, RecoveryData: rec.RecoveryData,
		store: h.store, tx: h.tx, bg: bg, now: h.cfg.now, leaseFor: h.cfg.lease,
		leaseUntil: rec.LeaseUntil, point: rec.RecoveryPoint, created: rec.CreatedAt,
	}
	if res.Outcome == ClaimCreated {
		run.execID = execID
	} else if sr, err := DecodeRequest(rec.Request); err == nil {
		run.execID = sr.ID
	}
	return run
}

// run executes the handler as the owner of rec and answers through w.
// bg is r's context without its cancellation: store calls keep going when
// the client disconnects. parent is the context the handler's derives from:
// for the middleware, detach's (the client going away does not end it);
// for the Completer, its own.
//
// The handler's context carries the Run and has parent's values, deadline
// and cancellation, plus cancellation with cause ErrLeaseLost (or
// ErrLeaseExpired) from the heartbeat and, under WithShutdown, with the
// shutdown context's cause when it ends. No unit of work is open yet:
// Run.Unit (or sqlstore.Tx) begins the request's unit when the handler
// first asks for it; else the completion is one Store.Complete. The capture and the
// request body are not in the Run, so that a context of the handler's that
// outlives the request does not keep them alive.
func (h *handler) run(w http.ResponseWriter, r *http.Request, bg, parent context.Context, req request, res ClaimResult) outcome {
	start := time.Now()
	run := h.newRun(bg, req.scope, res, req.execID)
	hctx, cancel := context.WithCancelCause(withRun(parent, run))
	defer cancel(nil)
	if sd := h.cfg.shutdown; sd != nil && sd.Done() != nil {
		stop := context.AfterFunc(sd, func() { cancel(context.Cause(sd)) })
		defer stop()
	}
	run.cancel = cancel
	x := &invocation{cw: capture{w: w, header: make(http.Header)}}
	hb := h.startHeartbeat(&x.hb, bg, run, cancel)
	cw := &x.cw
	r2 := r.WithContext(hctx)
	x.body.Reset(req.body)
	r2.Body = &x.body
	r2.ContentLength = int64(len(req.body))

	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (or called runtime.Goexit): give the key up
		// (or keep it for a resume after a committed phase) and let the
		// panic continue to net/http.
		hb.stop()
		unit, _ := run.close()
		rollback(unit)
		hb.settle()
		h.log(bg, slog.LevelWarn, "idempotency: handler panicked; giving up the key", req.scope,
			"recovery_point", run.currentPoint())
		h.abort(bg, run.Lease, run.currentPoint())
	}()
	h.next.ServeHTTP(cw, r2)
	returned = true
	hb.stop()
	o := h.finish(bg, w, req, run, cw, hb)
	if f := h.cfg.obs.Executed; f != nil {
		f(bg, Event{Scope: req.scope, Outcome: o.String(), Status: cw.statusCode(),
			Generation: run.Lease.Generation, Duration: time.Since(start)})
	}
	return o
}

// String returns the Outcome* constant of o.
func (o outcome) String() string {
	return [...]string{OutcomeCompleted, OutcomeReleased, OutcomeKept, OutcomeLost, OutcomeFailed}[o]
}

// detach returns the context in which the handler of a claimed request
// runs: bg (the request's context ctx without its cancellation, so with all
// its values) with ctx's deadline, if it has one, applied again (its own, or
// the one deadline.Middleware set from the client's propagated time). The
// client going away does not end it: the work runs to its end, its response
// is stored, and the client's retry replays it instead of running the work
// again. The caller must call the returned cancel when the handler returns.
func detach(ctx, bg context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok {
		return context.WithDeadline(bg, d)
	}
	return bg, func() {}
}

// invocation is the middleware's side of one execution of the handler,
// which the handler never sees: its response capture, its request body and
// the heartbeat of its lease (one allocation for the three).
type invocation struct {
	cw   capture
	body bodyReader
	hb   heartbeat
}

// bodyReader is the handler's request body: the bytes the middleware read,
// with a Close that does nothing.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

// verdict is what the outcome of a handler that returned means for its
// record.
type verdict int

const (
	verdictStore      verdict = iota // store the response, then send it
	verdictRelease                   // an unstored status: give the key up, then send the response
	verdictIncomplete                // an External call's outcome is unknown: keep the record, answer 503
)

// decide returns the verdict for a handler that answered status with the
// record at recovery point point. An unknown External outcome comes first:
// whatever the handler answered, storing it would replay it for whatever
// the call did, and sending it (a plain 409 or 500) would make the client
// give up while the call may have gone through.
func (h *handler) decide(status int, point string) verdict {
	switch {
	case strings.HasPrefix(point, intentPrefix):
		return verdictIncomplete
	case !h.stores(status):
		return verdictRelease
	}
	return verdictStore
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

// finish settles the record of a handler that returned and answers its
// client: decide what the outcome means, store it, answer.
//
// A run whose heartbeats failed until its lease was about to end had its
// context canceled (so that it starts nothing new), but what it did is still
// completed: the completion is fenced on owner and generation, so it fails
// with ErrLeaseLost if a successor took over and stores the work (never to
// be repeated) if none did.
//
// Before it gives the key up (abort), it waits for a heartbeat still in
// flight (hb.settle), once the request's unit is rolled back: a late beat
// would extend again a lease that abort ends at once for a resume.
func (h *handler) finish(bg context.Context, w http.ResponseWriter, req request, run *Run, cw *capture, hb *heartbeat) outcome {
	scope, fp := req.scope, req.fp
	unit, err := run.close()
	lease, point := run.Lease, run.currentPoint()
	if err != nil {
		// The handler asked for its unit and the store could not begin it:
		// whatever the handler answered, nothing of its unit committed.
		hb.settle()
		return h.unavailable(bg, w, lease, point, err)
	}
	status := cw.statusCode()
	switch h.decide(status, point) {
	case verdictIncomplete:
		rollback(unit)
		hb.settle()
		h.log(bg, slog.LevelError, "idempotency: the handler answered while an external call's outcome is unknown; "+
			"its response is neither stored nor sent and the record is kept for a resume", scope,
			"status", status, "recovery_point", point, "generation", lease.Generation)
		h.abort(bg, lease, point)
		writeProblem(w, http.StatusServiceUnavailable, CodeRequestIncomplete,
			"a call to another service made for this request has an unknown outcome; retry with the same key to finish it", nil)
		return outcomeKept
	case verdictRelease:
		rollback(unit)
		hb.settle()
		kept := h.abort(bg, lease, point)
		cw.release()
		if kept {
			return outcomeKept
		}
		return outcomeReleased
	}
	transactional := unit != nil
	start := time.Now()
	err = h.complete(bg, lease, unit, h.response(bg, scope, cw))
	h.storeCall(bg, OpComplete, scope, start, err)
	switch {
	case err == nil:
		cw.release()
		return outcomeCompleted
	case errors.Is(err, ErrLeaseLost):
		h.log(bg, slog.LevelWarn, "idempotency: lease lost before completion; the response is discarded", scope,
			"generation", lease.Generation)
		h.answerLost(bg, w, scope, fp)
		return outcomeLost
	case transactional:
		// Nothing of the handler's unit committed.
		hb.settle()
		return h.unavailable(bg, w, lease, point, err)
	default:
		// The handler wrote nothing through a unit: its work was done and
		// cannot be undone, so send it. The record stays in progress until
		// its lease expires.
		h.log(bg, slog.LevelError, "idempotency: storing the response failed; sending it unstored", scope, "err", err)
		cw.release()
		return outcomeFailed
	}
}

// response returns the Response to store for what cw captured: its status,
// a copy of its allow-listed headers, and its body, or, over the stored-body
// cap, no body and the mark that replays answer CodeResponseNotReplayable.
func (h *handler) response(bg context.Context, scope Scope, cw *capture) Response {
	resp := Response{Status: cw.statusCode(), Header: make(http.Header, len(cw.header))}
	for k, v := range cw.header {
		if k = http.CanonicalHeaderKey(k); h.cfg.replayHeaders[k] {
			resp.Header[k] = v // the store copies what it keeps
		}
	}
	if n := cw.body.Len(); n > h.cfg.maxStoredBody {
		resp.Header.Set(notReplayableHeader, "body-too-large")
		h.log(bg, slog.LevelWarn, "idempotency: response body over the stored-body cap; replays will answer "+CodeResponseNotReplayable,
			scope, "bytes", n, "cap", h.cfg.maxStoredBody)
		return resp
	}
	resp.Body = cw.body.Bytes()
	return resp
}

// complete stores resp as the record's response, fenced on lease: in the
// request's unit when the handler began one (an error then means that
// nothing of the unit committed); else with Store.Complete, one conditional
// write and no transaction (on a SQL store, one statement in autocommit).
func (h *handler) complete(bg context.Context, lease Lease, unit Unit, resp Response) error {
	ctx, cancel := boundedCtx(bg)
	defer cancel()
	now := h.cfg.now()
	if unit == nil {
		return h.store.Complete(ctx, lease, resp, now)
	}
	err := unit.Complete(ctx, resp, now)
	if err == nil {
		err = unit.Commit()
	}
	if err != nil {
		_ = unit.Rollback()
	}
	return err
}

// rollback rolls unit back, if there is one.
func rollback(unit Unit) {
	if unit != nil {
		_ = unit.Rollback()
	}
}

// unavailable answers 503 after the store failed to begin or commit the
// request's unit, and gives the key up (or keeps it for a resume).
func (h *handler) unavailable(bg context.Context, w http.ResponseWriter, lease Lease, point string, err error) outcome {
	h.abort(bg, lease, point)
	h.storeUnavailable(bg, w, lease.Scope, err)
	return outcomeFailed
}

// answerLost answers the client of an execution that lost its lease: the
// successor's stored response if it completed, else 409 in progress.
func (h *handler) answerLost(bg context.Context, w http.ResponseWriter, scope Scope, fp string) {
	ctx, cancel := boundedCtx(bg)
	defer cancel()
	rec, err := h.store.Get(ctx, scope)
	if err == nil && rec.State == Completed && h.answerSettled(bg, w, fp, rec) {
		return
	}
	observe(h.cfg.obs.Conflict, bg, Event{Scope: scope, Status: http.StatusConflict, Code: CodeInProgress})
	writeProblem(w, http.StatusConflict, CodeInProgress,
		"another execution took over this idempotency key; retry later with the same key", nil)
}

// abort gives the key up after an unstored outcome: Release, unless the
// record holds a recovery point, in which case the lease is ended at once
// so that a retry takes the record over and resumes.
//
// It reports whether the record was kept.
func (h *handler) abort(bg context.Context, lease Lease, recoveryPoint string) bool {
	ctx, cancel := boundedCtx(bg)
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
	start := time.Now()
	if keep {
		err = h.store.EndLease(ctx, lease, h.cfg.now())
		h.storeCall(bg, OpEndLease, lease.Scope, start, err)
	} else {
		err = h.store.Release(ctx, lease)
		h.storeCall(bg, OpRelease, lease.Scope, start, err)
	}
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		h.log(bg, slog.LevelError, "idempotency: giving up the key failed; it stays claimed until its lease expires",
			lease.Scope, "err", err, "release", !keep)
	}
	return keep
}
