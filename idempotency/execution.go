package idempotency

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"
)

// execution is the middleware's side of one run of a handler that owns its
// record, which the handler never sees: its response capture and the
// heartbeat of its lease.
type execution struct {
	m          *Middleware
	run        *Run
	bg         context.Context // not canceled with the client: the store calls after the handler use it
	req        request
	start      time.Time
	background bool // the Completer's
	cw         capture
	hb         heartbeat
}

// run executes the handler as the owner of res.Record and answers through
// w, and returns the outcome (see Observer.Executed). bg is r's context
// without its cancellation. parent is the context the handler's derives
// from: for the middleware, detach's (the client going away does not end
// it); for the Completer, its own. The handler's context carries the Run
// and is also canceled on a lost lease (cause ErrLeaseLost) and, under
// WithShutdown, when that context ends.
func (h *handler) run(w http.ResponseWriter, r *http.Request, bg, parent context.Context, req request,
	res ClaimResult, background bool) Outcome {
	m := h.m
	rec := res.Record
	run := m.newRun(bg, req, res)
	hctx, cancel := context.WithCancelCause(withRun(parent, run))
	defer cancel(nil)
	if sd := m.cfg.shutdown; sd != nil && sd.Done() != nil {
		stop := context.AfterFunc(sd, func() { cancel(context.Cause(sd)) })
		defer stop()
	}
	run.cancel = cancel
	x := &execution{m: m, run: run, bg: bg, req: req, start: time.Now(), background: background,
		cw: capture{w: w, header: make(http.Header)}}
	x.hb.start(m, run, bg, cancel)
	r2 := r.WithContext(hctx)
	r2.Body = io.NopCloser(bytes.NewReader(req.input.body))
	r2.ContentLength = int64(len(req.input.body))

	returned := false
	defer func() {
		if !returned {
			// The handler (or an observer) panicked, or called
			// runtime.Goexit: give the key up, or keep it for a resume,
			// and let the panic go on to net/http.
			s := x.end(nil)
			x.report(OutcomePanicked, context.Cause(hctx), s.err)
		}
	}()
	m.obs.claimed(bg, Event{Scope: req.scope, Claim: res.Outcome, Generation: rec.Generation,
		RecoveryPoint: rec.RecoveryPoint, Background: background})
	h.next.ServeHTTP(&x.cw, r2)
	returned = true
	outcome, err := x.finish()
	x.report(outcome, context.Cause(hctx), err)
	return outcome
}

// report tells the observers how the execution ended: err is the store's,
// cause the handler context's, reported when the middleware canceled it for
// its lease.
func (x *execution) report(outcome Outcome, cause, err error) {
	if err == nil && errors.Is(cause, ErrLeaseLost) {
		err = cause
	}
	x.m.obs.executed(x.bg, Event{Scope: x.req.scope, Outcome: outcome, Status: x.cw.statusCode(),
		Generation: x.run.Lease.Generation, RecoveryPoint: x.run.currentPoint(), Duration: time.Since(x.start),
		Err: err, Background: x.background})
}

// detach returns the context in which the handler of a claimed request
// runs: bg (the request's context ctx without its cancellation) with ctx's
// deadline, if it has one. The caller calls cancel when the handler returns.
func detach(ctx, bg context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok {
		return context.WithDeadline(bg, d)
	}
	return bg, func() {}
}

// finish settles the record of a handler that returned, answers its client
// and returns the outcome and the store's error.
func (x *execution) finish() (Outcome, error) {
	status := x.cw.statusCode()
	// An External call's outcome is unknown: whatever the handler answered,
	// storing it would replay it for whatever the call did, and sending it
	// (a 409, a 500) would make the client give up while the call may have
	// gone through.
	incomplete := strings.HasPrefix(x.run.currentPoint(), intentPrefix)
	var resp *Response
	if !incomplete && x.m.stores(status) {
		r := x.response()
		resp = &r
	}
	s := x.end(resp)
	switch {
	case errors.Is(s.err, ErrLeaseLost):
		x.answerLost()
		return OutcomeLost, s.err
	case s.undone:
		writeProblem(x.cw.w, http.StatusServiceUnavailable, CodeStoreUnavailable, "", 0)
		return OutcomeFailed, s.err
	case s.err != nil:
		x.cw.release() // the work is done and cannot be undone: send it
		return OutcomeFailed, s.err
	case incomplete:
		writeProblem(x.cw.w, http.StatusServiceUnavailable, CodeRequestIncomplete,
			"a call to another service made for this request has an unknown outcome; retry with the same key to finish it", 0)
		return OutcomeIncomplete, nil
	}
	x.cw.release()
	switch {
	case resp != nil:
		return OutcomeCompleted, nil
	case s.kept:
		return OutcomeKept, nil
	}
	return OutcomeReleased, nil
}

// settled is how end left the record.
type settled struct {
	kept   bool  // the key was given up by ending the lease: a recovery point is kept
	err    error // the store's error that stopped it (ErrLeaseLost: a successor owns the record)
	undone bool  // nothing of the handler's unit committed: its answer must not be sent
}

// end ends the execution, whatever the path (a panic, an answer that is
// not stored, one that is, a lost lease, a failed store), in this order:
//
//  1. the heartbeat stops: no beat starts after it;
//  2. the Run closes: Phase, External and Unit fail from now on, and the
//     request's unit, if the handler began one, is handed over;
//  3. with resp, the response is stored, in that unit (then committed) or
//     with Store.Complete, without waiting for a beat in flight, which may
//     wait for the lock that very unit holds; stored, or lost to a
//     successor, the record is settled; a failure outside a unit leaves it
//     in progress until its lease expires (the work was done);
//  4. otherwise the unit is rolled back, a beat still in flight is waited
//     for (it would extend again the lease that 5 ends), and
//  5. the key is given up: Release, or EndLease when the record holds a
//     recovery point, so that a retry takes it over and resumes.
func (x *execution) end(resp *Response) settled {
	x.hb.stop()
	unit, err := x.run.close()
	if err != nil {
		resp = nil // the unit never began: nothing of it can commit
	}
	s := settled{err: err, undone: err != nil}
	if resp != nil {
		s.err = x.complete(unit, *resp)
		if s.err == nil || (unit == nil && !errors.Is(s.err, ErrLeaseLost)) {
			return s
		}
		s.undone = unit != nil
	}
	if unit != nil {
		_ = unit.Rollback()
	}
	if errors.Is(s.err, ErrLeaseLost) {
		return s // a successor owns the record: nothing to give up
	}
	x.hb.settle()
	kept, err := x.giveUp()
	s.kept = kept
	if err != nil {
		s.err = err
	}
	return s
}

// complete stores resp as the record's response, fenced on the lease: in
// the request's unit when the handler began one (an error then means that
// nothing of it committed), else with Store.Complete, one conditional write.
func (x *execution) complete(unit Unit, resp Response) error {
	ctx, cancel := storeCtx(x.bg)
	defer cancel()
	start := time.Now()
	lease := x.run.Lease
	var err error
	if unit == nil {
		err = x.m.store.Complete(ctx, lease, resp, time.Now())
	} else if err = unit.Complete(ctx, resp, time.Now()); err == nil {
		err = unit.Commit()
	}
	x.m.obs.storeCall(x.bg, OpComplete, lease.Scope, start, err)
	return err
}

// giveUp gives the key up after an answer that is not stored: Release,
// unless the record holds a recovery point, whose lease is then ended at
// once so that a retry takes it over and resumes. It reports whether the
// record was kept, and ErrLeaseLost when a successor owns the record.
func (x *execution) giveUp() (kept bool, err error) {
	ctx, cancel := storeCtx(x.bg)
	defer cancel()
	lease, keep := x.run.Lease, x.run.currentPoint() != ""
	if !keep {
		// A phase may have committed with a write whose answer was lost:
		// the store knows.
		rec, err := x.m.store.Get(ctx, lease.Scope)
		switch {
		case errors.Is(err, ErrNotFound):
			return false, nil
		case err != nil:
			keep = true // cannot tell: ending the lease is safe either way
		case rec.State != InProgress || rec.Owner != lease.Owner || rec.Generation != lease.Generation:
			return false, ErrLeaseLost // no longer ours
		default:
			keep = rec.RecoveryPoint != ""
		}
	}
	start := time.Now()
	op := OpRelease
	if keep {
		op = OpEndLease
		err = x.m.store.EndLease(ctx, lease, time.Now())
	} else {
		err = x.m.store.Release(ctx, lease)
	}
	x.m.obs.storeCall(x.bg, op, lease.Scope, start, err)
	if errors.Is(err, ErrLeaseLost) {
		return false, err
	}
	return keep, nil
}

// answerLost answers the client of an execution that lost its lease: the
// successor's stored response if it completed, else 409 in progress.
func (x *execution) answerLost() {
	ctx, cancel := storeCtx(x.bg)
	defer cancel()
	rec, err := x.m.store.Get(ctx, x.req.scope)
	if err == nil && rec.State == Completed && x.m.answer(x.bg, x.cw.w, x.req, rec) {
		return
	}
	writeProblem(x.cw.w, http.StatusConflict, CodeInProgress,
		"another execution took over this idempotency key; retry later with the same key", 0)
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

// response returns the Response to store for what the handler answered:
// its status, its allow-listed headers, and its body, or over the cap no
// body and the mark that makes replays answer CodeResponseNotReplayable.
func (x *execution) response() Response {
	cw := &x.cw
	resp := Response{Status: cw.statusCode(), Header: make(http.Header, len(cw.header))}
	for k, v := range cw.header {
		if k = http.CanonicalHeaderKey(k); x.m.cfg.replayHeaders[k] {
			resp.Header[k] = v // the store copies what it keeps
		}
	}
	if int64(cw.body.Len()) > x.m.cfg.maxStoredBody {
		resp.Header.Set(notReplayableHeader, "body-too-large")
		return resp
	}
	resp.Body = cw.body.Bytes()
	return resp
}
