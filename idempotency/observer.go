package idempotency

import (
	"context"
	"time"
)

// Outcomes of an execution, in Event.Outcome of Observer.Executed.
const (
	OutcomeCompleted = "completed" // the response is stored, then sent
	OutcomeReleased  = "released"  // an unstored status: the key was given up
	OutcomeKept      = "kept"      // unstored after a recovery point: kept in progress for a resume
	OutcomeLost      = "lost"      // the lease was lost: a successor owns the record
	OutcomeFailed    = "failed"    // a store failure; the record stays as it was
)

// Store operations, in Event.Op of Observer.StoreCall.
const (
	OpClaim    = "claim"
	OpGet      = "get"
	OpComplete = "complete"
	OpRelease  = "release"
	// OpHeartbeat is a heartbeat that extends a running handler's lease.
	OpHeartbeat = "heartbeat"
	// OpEndLease ends a kept record's lease at once (Store.EndLease).
	OpEndLease = "end_lease"
)

// Observer sees what the middleware (WithObserver) and the reaper
// (ReaperConfig.Observer) do with keyed requests. Each field is optional; a
// nil one costs a branch. Several observers given with WithObserver compose:
// each sees every event, in the order given.
//
// The functions run synchronously on the request's goroutine (the reaper's
// for Unfinished): they must be fast and must not block, and may be called
// concurrently. ctx is the request's context (without its cancellation after
// the handler returned). Event.Scope holds the raw key and principal: never
// log or export them, use keygen.Digest. A panic in them is not recovered.
type Observer struct {
	// Claimed is called when a request claimed its key: a fresh claim, or
	// (Takeover) the takeover of an in-progress record whose lease expired;
	// Generation is the record's fencing generation.
	Claimed func(ctx context.Context, e Event)
	// Executed is called when the handler of a claimed request returned and
	// its record was settled: Outcome (an Outcome* constant), Status (the
	// handler's status), Generation, Duration (from the handler's start to
	// the settled record, the store calls included). Not called when the
	// handler panicked.
	Executed func(ctx context.Context, e Event)
	// Replayed is called when a completed record's response is replayed:
	// Status is the replayed status.
	Replayed func(ctx context.Context, e Event)
	// Conflict is called for the middleware's conflict answers: Code
	// CodeInProgress (409, the record is in progress), CodeKeyReused (422
	// by default, WithMismatchStatus: the key was used for another
	// request), CodeResponseNotReplayable (409); Status is the status sent.
	Conflict func(ctx context.Context, e Event)
	// StoreCall is called after the request path's store calls: the
	// claim, the reads while waiting on a record in progress, the
	// completion outside a unit (or the unit's completion and commit), the
	// release, and every heartbeat: Op (an Op* constant), Duration (its
	// latency) and Err (nil on success; ErrNotFound and ErrLeaseLost are
	// answers, not failures). A unit's Begin, a phase's recovery point and
	// the reads made to answer a lost lease are not reported.
	StoreCall func(ctx context.Context, e Event)
	// Unfinished is called by the reaper for each unfinished record it
	// lists (see Report.Unfinished): Duration is its age (the run's now
	// minus its CreatedAt), Generation its generation.
	Unfinished func(ctx context.Context, e Event)
}

// Event describes one thing an Observer sees; which fields are set depends
// on the function (see each).
type Event struct {
	Scope      Scope // raw key and principal: never export them
	Status     int
	Code       string
	Outcome    string
	Op         string
	Err        error
	Generation int64
	Takeover   bool
	Duration   time.Duration
}

// WithObserver adds o to the middleware's observers (default none). A later
// WithObserver adds to the earlier ones; each sees every event.
func WithObserver(o Observer) Option {
	return func(c *config) { c.obs = c.obs.join(o) }
}

// join returns an Observer that calls o's functions, then p's.
func (o Observer) join(p Observer) Observer {
	return Observer{
		Claimed:    join(o.Claimed, p.Claimed),
		Executed:   join(o.Executed, p.Executed),
		Replayed:   join(o.Replayed, p.Replayed),
		Conflict:   join(o.Conflict, p.Conflict),
		StoreCall:  join(o.StoreCall, p.StoreCall),
		Unfinished: join(o.Unfinished, p.Unfinished),
	}
}

func join(f, g func(context.Context, Event)) func(context.Context, Event) {
	switch {
	case f == nil:
		return g
	case g == nil:
		return f
	}
	return func(ctx context.Context, e Event) { f(ctx, e); g(ctx, e) }
}

// observe calls f with e when f is set.
func observe(f func(context.Context, Event), ctx context.Context, e Event) {
	if f != nil {
		f(ctx, e)
	}
}

// storeCall reports a store call that began at start.
func (h *handler) storeCall(ctx context.Context, op string, s Scope, start time.Time, err error) {
	if f := h.cfg.obs.StoreCall; f != nil {
		f(ctx, Event{Scope: s, Op: op, Err: err, Duration: time.Since(start)})
	}
}
