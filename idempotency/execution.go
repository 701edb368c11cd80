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
// record, which the handler never sees: the handler's context, its response
// capture and the heartbeat of its lease. end is the one place that cleans
// up after it, whichever way the handler returned.
type execution struct {
	m          *Middleware
	run        *Run
	req        request
	start      time.Time
	background bool // the Completer's
	cw         capture
	hb         heartbeat
	ctx        context.Context // the handler's, which run.cancel cancels
	release    func()          // releases the deadline ctx derives from
	unhook     func() bool     // stops WithShutdown's cancellation of ctx
	code       Code            // CodeResponseNotReplayable: the stored response has no body
}

// run executes the handler as the owner of res.Record, answers through w,
// and returns the outcome (see Observer.Executed). The handler's context
// carries the Run; for a client's request it survives the client (it keeps
// only the request's deadline), for the Completer's it is r's. It is also
// canceled on a lost lease (cause ErrLeaseLost) and, under WithShutdown,
// when that context ends.
func (h *handler) run(w http.ResponseWriter, r *http.Request, req request, res ClaimResult,
	background bool) Outcome {
	x := h.m.newExecution(w, r.Context(), req, res, background)
	r2 := r.WithContext(x.ctx)
	r2.Body = io.NopCloser(bytes.NewReader(req.input.body))
	r2.ContentLength = int64(len(req.input.body))
	returned := false
	defer func() {
		if !returned {
			// The handler (or an observer) panicked, or called
			// runtime.Goexit: give the key up, or keep it for a resume,
			// and let the panic go on to net/http.
			x.end(false)
		}
	}()
	h.m.obs.claimed(x.run.bg, Event{Scope: req.scope, Claim: res.Outcome,
		Generation: res.Record.Generation, RecoveryPoint: res.Record.RecoveryPoint,
		Background: background})
	h.next.ServeHTTP(&x.cw, r2)
	returned = true
	return x.end(true)
}

// newExecution returns the execution of a request whose context is ctx,
// with its handler's context made and its heartbeat started.
func (m *Middleware) newExecution(w http.ResponseWriter, ctx context.Context, req request,
	res ClaimResult, background bool) *execution {
	bg := context.WithoutCancel(ctx)
	parent, release := ctx, func() {} // the Completer's: stopping it cancels the handler
	if !background {
		parent = bg
		if d, ok := ctx.Deadline(); ok {
			parent, release = context.WithDeadline(bg, d)
		}
	}
	run := m.newRun(bg, req, res)
	hctx, cancel := context.WithCancelCause(withRun(parent, run))
	unhook := func() bool { return false }
	if sd := m.cfg.shutdown; sd != nil && sd.Done() != nil {
		unhook = context.AfterFunc(sd, func() { cancel(context.Cause(sd)) })
	}
	run.cancel = cancel
	x := &execution{m: m, run: run, req: req, start: time.Now(), background: background,
		cw: capture{w: w, header: make(http.Header)}, ctx: hctx, release: release, unhook: unhook}
	x.hb.start(m, run)
	return x
}

// end ends the execution, whichever way the handler returned (returned
// false: it panicked or called runtime.Goexit), and returns the outcome:
// it settles the record and, when the handler returned, answers its
// client (settle, finish); then it ends the handler's context and tells
// the observers how the execution ended.
func (x *execution) end(returned bool) Outcome {
	outcome, err := OutcomePanicked, error(nil)
	if returned {
		outcome, err = x.finish()
	} else {
		err = x.settle(nil, false).err
	}
	cause := context.Cause(x.ctx)
	x.unhook()
	x.run.cancel(nil)
	x.release()
	x.report(outcome, cause, err)
	return outcome
}

// report tells the observers how the execution ended: err is the store's,
// cause the handler context's, reported when the middleware canceled it for
// its lease.
func (x *execution) report(outcome Outcome, cause, err error) {
	if err == nil && errors.Is(cause, ErrLeaseLost) {
		err = cause
	}
	x.m.obs.executed(x.run.bg, Event{Scope: x.req.scope, Outcome: outcome,
		Status: x.cw.statusCode(), Code: x.code, Generation: x.run.Lease.Generation,
		RecoveryPoint: x.run.currentPoint(), Duration: time.Since(x.start), Err: err,
		Background: x.background})
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
	// A resumed request carries no credentials: a refusal is the resume's,
	// not the client's. The client's retry, which has them, takes over.
	refused := x.background && (status == http.StatusUnauthorized || status == http.StatusForbidden)
	var resp *Response
	if !incomplete && !refused && x.m.stores(status) {
		r := x.response()
		resp = &r
	}
	s := x.settle(resp, refused)
	if errors.Is(s.err, ErrLeaseLost) {
		rec, err := x.m.get(x.run.bg, x.req.scope)
		if resp == nil || err != nil || rec.State != Completed || !ownedBy(rec, x.run.Lease) {
			x.answerLost(rec, err)
			return OutcomeLost, s.err
		}
		// Completed by this lease's owner and generation: a completion
		// whose outcome settle could not read applied after all.
		s = settled{}
	}
	switch {
	case s.undone:
		writeProblem(x.cw.w, http.StatusServiceUnavailable, CodeStoreUnavailable, "", 0)
		return OutcomeFailed, s.err
	case s.err != nil:
		x.cw.release() // the work is done and cannot be undone: send it
		return OutcomeFailed, s.err
	case incomplete:
		writeProblem(x.cw.w, http.StatusServiceUnavailable, CodeRequestIncomplete,
			"a call to another service made for this request has an unknown outcome; "+
				"retry with the same key to finish it", 0)
		return OutcomeIncomplete, nil
	}
	x.cw.release()
	switch {
	case resp != nil:
		if resp.Header.Get(notReplayableHeader) != "" {
			x.code = CodeResponseNotReplayable
		}
		return OutcomeCompleted, nil
	case refused:
		return OutcomeNeedsCredentials, nil
	case s.kept:
		return OutcomeKept, nil
	}
	return OutcomeReleased, nil
}

// settled is how settle left the record.
type settled struct {
	kept   bool  // the key was given up by ending the lease: a recovery point is kept
	err    error // the store's error that stopped it (ErrLeaseLost: a successor owns the record)
	undone bool  // nothing of the handler's unit committed: its answer must not be sent
}

// settle settles the record after the handler, in this order:
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
//     recovery point or keep is set, so that a retry takes it over and
//     resumes.
func (x *execution) settle(resp *Response, keep bool) settled {
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
		x.m.rollback(x.run.bg, x.req.scope, unit)
	}
	if errors.Is(s.err, ErrLeaseLost) {
		return s // a successor owns the record: nothing to give up
	}
	x.hb.settle()
	kept, err := x.giveUp(keep)
	s.kept = kept
	if err != nil {
		s.err = err
	}
	return s
}

// complete stores resp as the record's response, fenced on the lease: in
// the request's unit when the handler began one (an error then means that
// nothing of it committed), else with Store.Complete, one conditional write
// tried again within its bound after a failure (fenced). When whether it
// applied is unknown (a lost connection, a commit whose answer was lost),
// the record says: completed by this lease's owner and generation, it is
// this execution's completion.
func (x *execution) complete(unit *openUnit, resp Response) error {
	lease := x.run.Lease
	done := func(rec Record, err error) bool {
		return err == nil && rec.State == Completed && ownedBy(rec, lease)
	}
	if unit == nil {
		return x.m.fenced(x.run.bg, OpComplete, lease, func(ctx context.Context) error {
			return x.m.store.Complete(ctx, lease, resp, time.Now())
		}, done)
	}
	return x.m.commit(x.run.bg, OpComplete, lease, unit, func(ctx context.Context) error {
		return unit.Complete(ctx, resp, time.Now())
	}, done)
}

// giveUp gives the key up after an answer that is not stored: Release,
// unless the record holds a recovery point or keep is set; the record's
// lease is then ended at once so that a retry takes it over and resumes.
// It reports whether the record was kept, and ErrLeaseLost when a
// successor owns the record.
func (x *execution) giveUp(keep bool) (kept bool, err error) {
	bg := x.run.bg
	lease := x.run.Lease
	keep = keep || x.run.currentPoint() != ""
	if !keep {
		// A phase may have committed with a write whose answer was lost:
		// the store knows.
		rec, err := x.m.get(bg, lease.Scope)
		switch {
		case errors.Is(err, ErrNotFound):
			return false, nil
		case err != nil:
			keep = true // cannot tell: ending the lease is safe either way
		case rec.State != InProgress || !ownedBy(rec, lease):
			return false, ErrLeaseLost // no longer ours
		default:
			keep = rec.RecoveryPoint != ""
		}
	}
	if keep {
		err = x.m.fenced(bg, OpEndLease, lease, func(ctx context.Context) error {
			return x.m.store.Heartbeat(ctx, lease, time.Now())
		}, nil)
	} else {
		released := func(_ Record, err error) bool { return errors.Is(err, ErrNotFound) }
		err = x.m.fenced(bg, OpRelease, lease, func(ctx context.Context) error {
			return x.m.store.Release(ctx, lease)
		}, released)
	}
	if errors.Is(err, ErrLeaseLost) {
		return false, err
	}
	return keep, nil
}

// answerLost answers the client of an execution that lost its lease, from
// rec, the record as read after it (err the read's): the successor's
// stored response if it completed, else 409 in progress.
func (x *execution) answerLost(rec Record, err error) {
	if err == nil && rec.State == Completed && x.m.answer(x.run.bg, x.cw.w, x.req, rec) {
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
