package idempotency

import (
	"context"
	"time"
)

// Observer sees what the middleware (both doors), its Completer and its
// Reaper do (WithObserver). Each field is optional; a nil one costs a branch. The
// functions run synchronously on the goroutine that does the work (the
// request's, or the job's): they must be fast, must not block, and may be
// called concurrently. A panic in them is not recovered. Event.Scope and
// Record.Scope hold the raw key and principal: never log or export them
// (keygen.Digest them).
type Observer struct {
	// Claimed: a request, or the Completer (Background), claimed its key.
	// Claim is ClaimCreated or ClaimTakenOver; Generation the record's.
	Claimed func(ctx context.Context, e Event)
	// Executed: the handler of a claimed request (or the fn of a call of
	// Do) returned or panicked, and its record was settled. Outcome says
	// how (an Outcome* constant); Status is the handler's (0 for Do),
	// Duration from its start to the settled record; Err is also set, to
	// the cause, when the middleware canceled the handler's context (a
	// lost lease, or heartbeats that failed until the lease was about to
	// run out). Code is CodeResponseNotReplayable when the response
	// completed the record without its body, which was over
	// WithMaxStoredBody: its replays answer that code.
	Executed func(ctx context.Context, e Event)
	// Replayed: a stored response was replayed with Status (0 for Do).
	Replayed func(ctx context.Context, e Event)
	// Refused: the middleware answered a guarded request with a problem of
	// its own before any handler ran, or a call of Do with the matching
	// error (Status 0): Status, Code (a Code* constant), and for
	// CodeStoreUnavailable and CodeStoreFull the store's error (Err), for
	// CodePrincipalUnavailable and CodePrincipalRefused the principal
	// function's.
	Refused func(ctx context.Context, e Event)
	// StoreCall: a store call that the middleware, its Completer or its
	// Reaper made ended (every call each makes): Op (an Op* constant),
	// Scope (zero for OpAbandoned and OpDeleteBefore), Duration its
	// latency, Err its error. ErrNotFound, ErrLeaseLost, ErrStoreFull and
	// ErrRecordTooLarge are answers, not failures.
	StoreCall func(ctx context.Context, e Event)
	// Unfinished: the Reaper is about to delete rec, an in-progress record
	// whose lease ended before the cleanup horizon: its request started and
	// never completed, so its side effects may be half done. age is now
	// minus its CreatedAt.
	Unfinished func(ctx context.Context, rec Record, age time.Duration)
	// CompleterRun: a Completer run ended, with its report and error.
	CompleterRun func(ctx context.Context, rep CompleterReport, err error)
	// ReaperRun: a Reaper run ended, with its report and error.
	ReaperRun func(ctx context.Context, rep ReaperReport, err error)
}

// Event describes one thing an Observer sees; which fields are set depends
// on the function (see Observer).
type Event struct {
	Scope         Scope
	Claim         ClaimOutcome
	Outcome       Outcome
	Code          Code
	Op            Op
	Status        int
	Generation    int64
	RecoveryPoint string
	Duration      time.Duration
	Err           error
	Background    bool // the Completer's execution
}

// Outcome is how an execution ended, in Event.Outcome of Observer.Executed:
// a snake_case label for logs and metrics.
type Outcome string

// The outcomes of an execution.
const (
	// OutcomeCompleted: the response was stored, then sent.
	OutcomeCompleted Outcome = "completed"
	// OutcomeReleased: an answer that is not stored; the key was given up.
	OutcomeReleased Outcome = "released"
	// OutcomeKept: an answer that is not stored after a committed phase;
	// the record stays in progress, its lease ended, for a resume.
	OutcomeKept Outcome = "kept"
	// OutcomeIncomplete: the handler answered while an External call's
	// outcome was unknown; kept, answered 503 CodeRequestIncomplete.
	OutcomeIncomplete Outcome = "incomplete"
	// OutcomePanicked: the handler panicked; released or kept as above.
	OutcomePanicked Outcome = "panicked"
	// OutcomeLost: the lease was lost; the response was discarded.
	OutcomeLost Outcome = "lost"
	// OutcomeFailed: a store call failed (Err); a unit's writes did not
	// commit (503), or a response made outside one was sent unstored.
	OutcomeFailed Outcome = "failed"
	// OutcomeNeedsCredentials (Completer only): the resumed handler
	// answered 401 or 403. A resumed request carries no credentials, so
	// that answer is never stored: the record stays in progress, its lease
	// ended, for the client's retry (which has them) to take over and
	// resume; the Completer backs off from it.
	OutcomeNeedsCredentials Outcome = "needs_credentials"
	// OutcomeUnresumable (Completer only): no handler for the record's
	// route, or its stored request cannot be rebuilt (Err); it was not run.
	OutcomeUnresumable Outcome = "unresumable"
)

// Op is a store call, in Event.Op of Observer.StoreCall: a snake_case
// label for logs and metrics. Each Store, Sweeper, Transactor and Unit
// method the library calls has its own, and a Heartbeat that ends a lease
// (to resume later) is OpEndLease; a Unit's Commit is part of the write it
// commits.
type Op string

// The store calls.
const (
	OpClaim            Op = "claim"
	OpGet              Op = "get"
	OpHeartbeat        Op = "heartbeat"
	OpEndLease         Op = "end_lease" // a Heartbeat to now: the lease ends for a resume
	OpComplete         Op = "complete"  // with a unit: its completion and commit
	OpRelease          Op = "release"
	OpSetRecoveryPoint Op = "set_recovery_point" // with a unit: the phase's and its commit
	OpBegin            Op = "begin"
	OpRollback         Op = "rollback"
	OpAbandoned        Op = "abandoned"
	OpDeleteBefore     Op = "delete_before"
)

// observers calls every Observer in order.
type observers []Observer

func (o observers) claimed(ctx context.Context, e Event) {
	for _, x := range o {
		if x.Claimed != nil {
			x.Claimed(ctx, e)
		}
	}
}

func (o observers) executed(ctx context.Context, e Event) {
	for _, x := range o {
		if x.Executed != nil {
			x.Executed(ctx, e)
		}
	}
}

func (o observers) replayed(ctx context.Context, e Event) {
	for _, x := range o {
		if x.Replayed != nil {
			x.Replayed(ctx, e)
		}
	}
}

func (o observers) refused(ctx context.Context, e Event) {
	for _, x := range o {
		if x.Refused != nil {
			x.Refused(ctx, e)
		}
	}
}

// storeCall reports a store call on s that began at start.
func (o observers) storeCall(ctx context.Context, op Op, s Scope, start time.Time, err error) {
	for _, x := range o {
		if x.StoreCall != nil {
			x.StoreCall(ctx, Event{Scope: s, Op: op, Duration: time.Since(start), Err: err})
		}
	}
}

func (o observers) unfinished(ctx context.Context, rec Record, age time.Duration) {
	for _, x := range o {
		if x.Unfinished != nil {
			x.Unfinished(ctx, rec, age)
		}
	}
}

func (o observers) completerRun(ctx context.Context, rep CompleterReport, err error) {
	for _, x := range o {
		if x.CompleterRun != nil {
			x.CompleterRun(ctx, rep, err)
		}
	}
}

func (o observers) reaperRun(ctx context.Context, rep ReaperReport, err error) {
	for _, x := range o {
		if x.ReaperRun != nil {
			x.ReaperRun(ctx, rep, err)
		}
	}
}
