package idempotency

import (
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// pollInterval is how often a call waiting on a record in progress reads
// it (WithMaxInProgressWait).
const pollInterval = 100 * time.Millisecond

// maxClaims is how many claims one call makes at most: the first, and a
// new one each time the record it waits on is released or its lease ends.
const maxClaims = 3

// notReplayableHeader marks a stored Response whose body was over the
// stored-body cap: its replays answer CodeResponseNotReplayable (Do:
// ErrOutputTooLarge). It never reaches a client.
const notReplayableHeader = "Saferetry-Not-Replayable"

// errNilStore is the error of a Middleware made with a nil store: it
// answers every guarded request 503 CodeStoreUnavailable, every call of Do
// ErrStoreUnavailable, and its Completer's and Reaper's runs fail with it.
var errNilStore = errors.New("idempotency: no store (nil): unavailable")

// Middleware is the one core of the server half, with its doors: Wrap, the
// HTTP door, guards the requests of the handlers it wraps; Do, the function
// door, guards the calls of jobs, scripts and message consumers. Either
// way the work takes effect effectively once within its key scope and
// replay window (see the package doc and docs/CONTRACT.md). Its Completer
// and Reaper share its store and policy. A Middleware is safe for
// concurrent use.
type Middleware struct {
	cfg     config
	g       gateway
	obs     observers // the logging observer first
	horizon time.Duration
}

// New returns the Middleware for store, configured by opts: the one value
// that serves every door. It never fails: option values it cannot honour
// are documented by each option. A nil store answers every guarded
// request 503 CodeStoreUnavailable and every call of Do
// ErrStoreUnavailable, and the runs of its Completer and Reaper fail.
func New(store Store, opts ...Option) *Middleware {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	m := &Middleware{cfg: cfg, horizon: max(cfg.horizon, addSat(cfg.replayWindow, cfg.lease))}
	if cfg.logger != nil {
		m.obs = append(m.obs, newLogObserver(cfg.logger))
	}
	m.obs = append(m.obs, cfg.observers...)
	m.g = newGateway(store, m.obs)
	if cfg.oneTx && store != nil && m.g.claimTx == nil && cfg.logger != nil {
		cfg.logger.Warn("idempotency: WithOneTransaction: the store cannot claim in a " +
			"transaction (not a ClaimTransactor); every request runs the multi-step lifecycle")
	}
	if cfg.monitorErr != nil && cfg.logger != nil {
		cfg.logger.Error("idempotency: the monitor is off", "error", cfg.monitorErr.Error())
	}
	return m
}

// request is one call through a door as the core sees it: its scope, what
// its fingerprint covers, what a claim that creates its record stores for
// the Completer, and its contexts.
type request struct {
	scope  Scope
	input  fingerprintInput
	fp     string // the fingerprint of fingerprintVersion
	stored []byte // Record.Request of a record this call creates
	// ctx is the caller's context; bg the same without its cancellation,
	// the one holder of it: the claim, every store call of the execution
	// and its units go on when the caller goes away, each bounded by the
	// gateway, so that the record is never left half written.
	ctx, bg context.Context
}

// newRequest returns the request of a call on ctx with scope s, whose
// fingerprint covers in, and which stores sr when it creates its record.
func newRequest(ctx context.Context, s Scope, in fingerprintInput, sr storedRequest) request {
	fp, _ := fingerprint(in, fingerprintVersion)
	return request{scope: s, input: in, fp: fp, stored: sr.encode(), ctx: ctx,
		bg: context.WithoutCancel(ctx)}
}

// payload returns the payload of a call of Do, nil for a request.
func (req request) payload() []byte {
	if req.scope.Method != "" {
		return nil
	}
	return req.input.body
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

// verdict is what a call does after a claim, or after a read of the record
// it waits on.
type verdict int

const (
	verdictRun    verdict = iota // the claim holds the record: run the work
	verdictReplay                // completed by the same request: answer from it
	verdictReused                // the record is another request's: conflict
	verdictBusy                  // in progress, no time left to wait: conflict
	verdictWait                  // in progress, time left: read it again after a pause
	verdictClaim                 // released, or its lease ended: claim again
)

// decide says what a call does about rec, the record as its last claim
// (acquired: the claim holds it) or its last read found it (Absent: there
// is none); same tells whether rec is the call's own request, now is the
// time, the call waits until waitUntil at most, and claims is how many
// claims it made. It decides and changes nothing; claim acts on it.
func decide(acquired bool, rec Record, same bool, now, waitUntil time.Time,
	claims int) verdict {
	switch {
	case acquired:
		return verdictRun
	case rec.State == Absent:
		if claims < maxClaims {
			return verdictClaim
		}
		return verdictBusy
	case !same:
		return verdictReused
	case rec.State == Completed:
		return verdictReplay
	case rec.LeaseUntil.Before(now) && claims < maxClaims:
		return verdictClaim // LeaseUntil < now: the claim takes it over
	case !now.Before(waitUntil):
		return verdictBusy
	}
	return verdictWait
}

// claimed is how a call's claim ended: the verdict (never verdictWait or
// verdictClaim), with the claim's result (for verdictRun) or the record;
// or err, the store's, or the caller's context's when gone: it went away
// while it waited, on the record in res. With an error the verdict means
// nothing.
type claimed struct {
	verdict verdict
	res     ClaimResult
	err     error
	gone    bool
}

// claim claims req's key, waiting on a record in progress as long as
// WithMaxInProgressWait allows and claiming again when it is released or
// its lease ends, and returns what decide made of it.
func (m *Middleware) claim(req request) claimed {
	if m.g.store == nil {
		return claimed{err: errNilStore}
	}
	claim := Claim{
		Scope: req.scope, Fingerprint: req.fp, FingerprintVersion: fingerprintVersion,
		Owner: rand.Text(), Request: req.stored, Now: time.Now(), LeaseFor: m.cfg.lease,
		ReplayWindow: m.cfg.replayWindow,
	}
	waitUntil := claim.Now.Add(m.cfg.wait)
	// The claims go on when the caller goes away: one that committed while
	// its caller gave up would leave the key in progress, with nobody to
	// finish or release it, until its lease expired.
	res, err := m.claimOnce(req, claim, waitUntil)
	for claims := 1; ; {
		if errors.Is(err, ErrInProgress) {
			// Another caller's transaction holds the key past the wait:
			// nothing of it can be read, so the answer says retry in 1 s.
			return claimed{verdict: verdictBusy, res: heldElsewhere(req.scope)}
		}
		if errors.Is(err, errCallerGone) { // a claim in one transaction ends with its caller
			return claimed{err: err, gone: true, res: heldElsewhere(req.scope)}
		}
		if err != nil {
			return claimed{err: err}
		}
		rec := res.Record
		switch v := decide(res.Acquired(), rec, sameRequest(req, rec), time.Now(), waitUntil,
			claims); v {
		case verdictWait:
			pause := min(time.Until(waitUntil), pollInterval)
			if err := wait.Sleep(req.ctx, pause); err != nil {
				return claimed{err: err, gone: true, res: res}
			}
			rec, err = m.g.get(req.ctx, kindGet, req.scope)
			switch {
			case req.ctx.Err() != nil: // the caller went away: not a store outage
				return claimed{err: context.Cause(req.ctx), gone: true, res: res}
			case errors.Is(err, ErrNotFound):
				rec, err = Record{}, nil
			}
			res = ClaimResult{Record: rec}
		case verdictClaim:
			claims++
			claim.Now = time.Now()
			claim.Fingerprint, claim.FingerprintVersion = req.fp, fingerprintVersion
			if rec.State == InProgress && rec.FingerprintVersion != fingerprintVersion {
				// A record of an older fingerprint version: a takeover
				// keeps its version, so the claim compares in it.
				if fp, ok := fingerprint(req.input, rec.FingerprintVersion); ok {
					claim.Fingerprint, claim.FingerprintVersion = fp, rec.FingerprintVersion
				}
			}
			res, err = m.claimOnce(req, claim, waitUntil)
		default:
			return claimed{verdict: v, res: res}
		}
	}
}

// heldElsewhere is the answer's record for a key that another caller's
// unit of work holds, which nothing can read: in progress, for 1 s more.
func heldElsewhere(s Scope) ClaimResult {
	return ClaimResult{Record: Record{Scope: s, State: InProgress,
		LeaseUntil: time.Now().Add(time.Second)}}
}

// claimOnce makes one claim of c for req, on req.bg: in a unit of the
// store's under WithOneTransaction (when the store is a ClaimTransactor),
// waiting on a key another unit holds until waitUntil at most, and no
// longer than req.ctx lives (such a claim commits nothing on its own, so
// it can end with its caller), and the ordinary way when the store says
// so; else the ordinary way.
func (m *Middleware) claimOnce(req request, c Claim, waitUntil time.Time) (ClaimResult, error) {
	if !m.cfg.oneTx || m.g.claimTx == nil {
		return m.g.claim(req.bg, c)
	}
	res, err := m.g.claimInUnit(req.bg, req.ctx, c, max(time.Until(waitUntil), 0))
	if err != nil || res.unit != nil || res.Record.State != Absent {
		return res, err
	}
	return m.g.claim(req.bg, c)
}

// ending is what a door's work came to, for the core to settle.
type ending struct {
	resp *Response // what to store; nil: nothing (the key is given up or kept)
	// needsCredentials: a resumed request was refused for want of
	// credentials; the record is kept for the client's retry.
	needsCredentials bool
	status           int  // for the observers: the handler's status (0 for Do)
	panicked         bool // set by the core: the work panicked or called runtime.Goexit
}

// settled is how the core left the record after the work.
type settled struct {
	stored     bool  // the response is stored: this execution completed the record
	kept       bool  // not stored: the record is kept, its lease ended, for a resume
	incomplete bool  // an External call's outcome is unknown: kept, nothing stored
	undone     bool  // the work's unit did not commit: nothing of it took effect
	err        error // the store's error that stopped it (ErrLeaseLost: lost)
	// rec is the record as read after the lease was lost (zero, with
	// recErr, when it could not be read): a successor's.
	rec    Record
	recErr error
}

// lost reports whether a successor owns the record.
func (s settled) lost() bool { return errors.Is(s.err, ErrLeaseLost) }

// outcome is how the execution ended, for the observers.
func (s settled) outcome(e ending) Outcome {
	switch {
	case s.lost():
		return OutcomeLost
	case s.err != nil:
		return OutcomeFailed
	case s.incomplete:
		return OutcomeIncomplete
	case s.stored:
		return OutcomeCompleted
	case e.needsCredentials:
		return OutcomeNeedsCredentials
	case s.kept:
		return OutcomeKept
	}
	return OutcomeReleased
}

// execution is the core's side of one run of a door's work that owns its
// record, which the work never sees: its Run, its context and the
// heartbeat of its lease. finish is the one place that cleans up after it,
// whichever way the work returned.
type execution struct {
	m          *Middleware
	run        *Run
	req        request
	start      time.Time
	background bool // the Completer's
	hb         heartbeat
	ctx        context.Context // the work's, which Run.cancelWork cancels
	stopHooks  func()          // releases the deadline and shutdown hook of ctx
}

// execute runs work as the owner of res.Record, on a context that carries
// its Run (FromContext), then settles the record and reports the
// execution, whichever way work returned; a panic of work (or its
// runtime.Goexit) goes on after that. The work's context is req.ctx, with
// its cancellation unless detach is set (a client's request: the work
// survives the client, and keeps only its deadline); it is also canceled
// on a lost lease (cause ErrLeaseLost) and, under WithShutdown, when that
// context ends.
func (m *Middleware) execute(req request, res ClaimResult, background, detach bool,
	work func(ctx context.Context, run *Run) ending) (ending, settled) {
	x := m.newExecution(req, res, background, detach)
	returned := false
	var e ending
	var s settled
	defer func() {
		if !returned {
			// The work (or an observer) panicked, or called
			// runtime.Goexit: give the key up, or keep it for a resume.
			x.finish(ending{panicked: true})
		}
	}()
	m.obs.claimed(req.bg, Event{Scope: req.scope, Claim: res.Outcome,
		Generation: res.Record.Generation, RecoveryPoint: res.Record.RecoveryPoint,
		Background: background})
	e = work(x.ctx, x.run)
	returned = true
	s = x.finish(e)
	return e, s
}

// newExecution returns the execution of req after a claim with res, with
// its work's context made and its heartbeat started.
func (m *Middleware) newExecution(req request, res ClaimResult, background,
	detach bool) *execution {
	parent, release := req.ctx, func() {}
	if detach {
		parent = req.bg
		if d, ok := req.ctx.Deadline(); ok {
			parent, release = context.WithDeadline(req.bg, d)
		}
	}
	run := m.newRun(req, res)
	ctx, cancel := context.WithCancelCause(withRun(parent, run))
	run.cancel = cancel
	unhook := func() bool { return false }
	if sd := m.cfg.shutdown; sd != nil && sd.Done() != nil {
		unhook = context.AfterFunc(sd, func() { run.cancelWork(context.Cause(sd)) })
	}
	x := &execution{m: m, run: run, req: req, start: time.Now(), background: background,
		ctx: ctx, stopHooks: func() { unhook(); release() }}
	if res.unit == nil { // a claim in one transaction holds its lease until it ends
		x.hb.start(m, run)
	}
	return x
}

// finish settles the record after the work (e: what it came to), ends the
// work's context and reports how the execution ended.
func (x *execution) finish(e ending) settled {
	s := x.settle(e)
	cause := context.Cause(x.ctx)
	x.stopHooks()
	x.run.cancelWork(nil)
	outcome := s.outcome(e)
	if e.panicked {
		outcome = OutcomePanicked
	}
	err := s.err
	if err == nil && errors.Is(cause, ErrLeaseLost) {
		err = cause // the core canceled the work for its lease
	}
	var code Code
	if s.stored && e.resp.Header.Get(notReplayableHeader) != "" {
		code = CodeResponseNotReplayable
	}
	x.m.obs.executed(x.req.bg, Event{Scope: x.req.scope, Outcome: outcome, Status: e.status,
		Code: code, Generation: x.run.Lease.Generation, RecoveryPoint: x.run.currentPoint(),
		Duration: time.Since(x.start), Err: err, Background: x.background})
	return s
}

// settle settles the record after the work, in this order:
//
//  1. the heartbeat stops: no beat starts after it;
//  2. the Run closes: Phase, External and Unit fail from now on, and the
//     request's unit (the store's, if the work began one, else an
//     auto-commit unit) is handed over;
//  3. with a response to store (and no External call whose outcome is
//     unknown), it is stored in that unit, without waiting for a beat in
//     flight, which may wait for the lock that very unit holds; stored, or
//     lost to a successor, the record is settled; a failure outside a unit
//     of the store's leaves it in progress until its lease expires (the
//     work was done);
//  4. otherwise the unit is ended (rolled back), a beat still in flight is
//     waited for (it would extend again the lease that 5 ends), and
//  5. the key is given up: released, or its lease ended when the record
//     holds a recovery point or the work needs credentials, so that a
//     retry takes it over and resumes;
//  6. after a lost lease, the record is read: completed by this lease's
//     owner and generation, it holds this execution's response (a
//     completion whose outcome could not be read applied after all).
func (x *execution) settle(e ending) settled {
	x.hb.stop()
	unit, err := x.run.close()
	s := settled{incomplete: strings.HasPrefix(x.run.currentPoint(), intentPrefix)}
	resp := e.resp
	if s.incomplete {
		// Whatever the work answered, storing it would replay it for
		// whatever the call did.
		resp = nil
	}
	if err != nil {
		resp, s.err, s.undone = nil, err, true // the unit never began: nothing of it can commit
	}
	if resp != nil {
		s.err = x.complete(unit, *resp)
		if s.err == nil {
			s.stored = true
			return s
		}
		if !unit.inTx && !errors.Is(s.err, ErrLeaseLost) {
			return s
		}
		s.undone = unit.inTx
	}
	x.m.g.end(x.req.bg, unit)
	if unit.claimed && !s.lost() {
		return s // the claim rolled back with the unit: the key is free, nothing to give up
	}
	if !s.lost() {
		x.hb.drain()
		kept, err := x.giveUp(e.needsCredentials)
		s.kept = kept
		if err != nil {
			s.err = err
		}
	}
	if s.lost() {
		s.rec, s.recErr = x.m.g.get(x.req.bg, kindGet, x.req.scope)
		if resp != nil && s.recErr == nil && s.rec.State == Completed &&
			ownedBy(s.rec, x.run.Lease) {
			return settled{stored: true}
		}
	}
	return s
}

// complete stores resp as the record's response in unit, fenced on the
// lease. When whether it applied is unknown, the record says: completed by
// this lease's owner and generation, it is this execution's completion.
func (x *execution) complete(unit *openUnit, resp Response) error {
	lease := x.run.Lease
	complete := func(ctx context.Context) error { return unit.Complete(ctx, resp, time.Now()) }
	return x.m.g.write(x.req.bg, kindComplete, kindCompleteInUnit, unit, complete,
		func(rec Record, err error) bool {
			return err == nil && rec.State == Completed && ownedBy(rec, lease)
		})
}

// giveUp gives the key up after an answer that is not stored: released,
// unless the record holds a recovery point or keep is set; the record's
// lease is then ended at once so that a retry takes it over and resumes.
// It reports whether the record was kept, and ErrLeaseLost when a
// successor owns the record (or it was completed: see settle).
func (x *execution) giveUp(keep bool) (kept bool, err error) {
	g, bg, lease := x.m.g, x.req.bg, x.run.Lease
	keep = keep || x.run.currentPoint() != ""
	if !keep {
		// A phase may have committed with a write whose answer was lost:
		// the store knows.
		rec, err := g.get(bg, kindGet, lease.Scope)
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
		err = g.endLease(bg, lease)
	} else {
		err = g.release(bg, lease)
	}
	if errors.Is(err, ErrLeaseLost) {
		return false, err
	}
	return keep, nil
}
