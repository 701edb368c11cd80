package idempotency

import "context"

// Run describes the execution of a guarded request that owns its record.
// The middleware puts it on the handler's request context; FromContext
// returns it. The handler must not retain it after returning.
type Run struct {
	// Scope is the record's scope (principal, method, route, key).
	Scope Scope
	// Lease is the owner token and fencing generation of this execution.
	Lease Lease
	// RecoveryPoint and RecoveryData are the record's recovery point at the
	// claim: "" and nil for a new request, the last committed phase when this
	// execution took over a record whose previous owner's lease expired.
	RecoveryPoint string
	RecoveryData  []byte
	// Unit is the transaction in which the middleware completes the record,
	// or nil when the store is not a Transactor. The handler's own writes
	// made through it (for the SQL store, sqlstore.Tx on the request
	// context) commit together with the stored response, or not at all.
	// The handler must not Commit or Rollback it.
	Unit Unit

	store Store
}

type runKey struct{}

// FromContext returns the Run of the guarded request whose context ctx is
// (or derives from), and false outside a guarded execution (pass-through,
// replays and conflicts never reach the handler).
func FromContext(ctx context.Context) (*Run, bool) {
	r, ok := ctx.Value(runKey{}).(*Run)
	return r, ok
}

func withRun(ctx context.Context, r *Run) context.Context {
	return context.WithValue(ctx, runKey{}, r)
}
