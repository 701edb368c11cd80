package idempotency

import (
	"context"
	"errors"
	"net/http"
	"time"
)

// State is the life-cycle state of an idempotency record: absent, then in
// progress, then completed. The zero value is Absent.
type State int

const (
	// Absent means no record exists for the scope (or it fell out of the
	// replay window): the next claim starts a new execution.
	Absent State = iota
	// InProgress means an owner holds a lease on the record and is running
	// the handler, or crashed while doing so.
	InProgress
	// Completed means the response is stored and every later request with
	// the same scope and fingerprint gets it replayed.
	Completed
)

// String returns "absent", "in_progress" or "completed".
func (s State) String() string {
	switch s {
	case Absent:
		return "absent"
	case InProgress:
		return "in_progress"
	case Completed:
		return "completed"
	}
	return "unknown"
}

// Scope identifies one logical request: the same key sent by another
// principal, to another route or with another method is another request.
type Scope struct {
	Principal string // authenticated identity, from the Principal function
	Method    string // HTTP method, upper case
	Route     string // the route pattern or path the middleware guards
	Key       string // the Idempotency-Key value, unquoted
}

// Response is a stored response, replayed verbatim: status, the allow-listed
// headers and the body.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
}

// Lease identifies one owner's hold on an in-progress record. Every write a
// store makes on behalf of an owner is conditional on Owner and Generation
// still matching the record: this is the fence that stops an owner whose lease
// expired from overwriting its successor.
type Lease struct {
	Scope      Scope
	Owner      string // random token chosen by the claimant
	Generation int64  // starts at 1, bumped by every takeover
}

// Record is the stored state of one scope.
type Record struct {
	Scope              Scope
	State              State
	Fingerprint        string // hex SHA-256 of the canonical request
	FingerprintVersion int    // algorithm version of Fingerprint
	Owner              string // current lease owner (in progress)
	Generation         int64  // fencing generation
	LeaseUntil         time.Time
	// RecoveryPoint is the last committed phase ("intent:<name>" while an
	// External call's outcome is unknown), "" before any; RecoveryData the
	// phases' state saved with it, opaque to stores.
	RecoveryPoint string
	RecoveryData  []byte
	// Request is the request saved when the record was created, opaque to
	// stores, for the Completer; a store may drop it at completion.
	Request     []byte
	Response    *Response
	CreatedAt   time.Time
	UpdatedAt   time.Time
	CompletedAt time.Time // zero unless Completed
}

// Lease returns the lease that the record's current owner holds.
func (r Record) Lease() Lease {
	return Lease{Scope: r.Scope, Owner: r.Owner, Generation: r.Generation}
}

// Claim is the argument to Store.Claim.
type Claim struct {
	Scope              Scope
	Fingerprint        string
	FingerprintVersion int
	Owner              string        // the claimant's fresh owner token
	Request            []byte        // stored with a new record (may be nil)
	Now                time.Time     // the store uses this, never its own clock
	LeaseFor           time.Duration // lease length: LeaseUntil = Now + LeaseFor
	ReplayWindow       time.Duration // a completed record older than this is treated as absent
	// TakeoverOnly makes the claim a takeover or nothing: it never creates
	// a record and never restarts a completed one (whatever ReplayWindow).
	// With no record the result is ClaimExisting with a zero Record (State
	// Absent). The Completer claims this way, so that a record that
	// vanished between its listing and its claim is not recreated without
	// its request.
	TakeoverOnly bool
}

// ClaimOutcome says what a Claim did. The zero value is ClaimExisting.
type ClaimOutcome int

const (
	// ClaimExisting: the claim changed nothing. Record is the record that
	// holds the scope, with Scope, State, Fingerprint, FingerprintVersion,
	// Owner, Generation and LeaseUntil set, and for a completed record
	// CompletedAt and Response too; Request, RecoveryPoint, RecoveryData,
	// CreatedAt and UpdatedAt may be left zero. A TakeoverOnly claim that
	// finds no record returns it with a zero Record (State Absent).
	ClaimExisting ClaimOutcome = iota
	// ClaimCreated: the claim created an in-progress record owned by
	// Claim.Owner (no record, or a completed one past the replay window).
	// Record has Scope, State, Fingerprint, FingerprintVersion, Owner,
	// Generation, LeaseUntil, CreatedAt and UpdatedAt set; all but
	// Generation are the claim's own values, so a store need only read
	// Generation back. RecoveryPoint, RecoveryData and Response are zero;
	// Request may be left zero (it is the claim's).
	ClaimCreated
	// ClaimTakenOver: the claim took over an in-progress record whose lease
	// had expired. Record is set as for ClaimCreated (Generation the bumped
	// one), plus the RecoveryPoint, RecoveryData, Request and CreatedAt
	// that the record kept from its first execution.
	ClaimTakenOver
)

// String returns "existing", "created" or "taken_over".
func (o ClaimOutcome) String() string {
	switch o {
	case ClaimExisting:
		return "existing"
	case ClaimCreated:
		return "created"
	case ClaimTakenOver:
		return "taken_over"
	}
	return "unknown"
}

// ClaimResult is what Store.Claim did, and the record as that outcome
// needs it (see ClaimOutcome for which fields are set).
type ClaimResult struct {
	Outcome ClaimOutcome
	Record  Record

	unit *openUnit // the core's: the unit a claim in one transaction holds the record in
}

// Acquired reports whether the claimant now owns the record: it was
// created or taken over.
func (r ClaimResult) Acquired() bool { return r.Outcome != ClaimExisting }

// Store errors: stores return them, wrapped or bare, for errors.Is.
var (
	// ErrNotFound: Get found no record for the scope.
	ErrNotFound = errors.New("idempotency: record not found")
	// ErrLeaseLost: a write conditional on a lease found that it no longer
	// holds (expired and taken over, released, or completed).
	ErrLeaseLost = errors.New("idempotency: lease lost")
	// ErrStoreFull: a bounded store (memstore) has no room for the record
	// a Claim would create, and created or changed nothing. It is never
	// returned for a claim of an existing record. The middleware answers
	// 503 CodeStoreFull with Retry-After: 1.
	ErrStoreFull = errors.New("idempotency: store full")
	// ErrRecordTooLarge: a bounded store could never hold the record a
	// Claim would create; nothing changed. The middleware answers 413
	// CodeRequestTooLarge, which a client does not retry.
	ErrRecordTooLarge = errors.New("idempotency: record larger than the store's limit")
)

// Store keeps idempotency records. Implementations must be safe for
// concurrent use by many goroutines and, for shared stores, many processes.
// Every method returns soon after its ctx ends: the middleware bounds each
// call it makes through ctx (10 s), and a unit's Commit through the
// context the unit was begun with (see Transactor). Every method takes the
// current time as an argument where it matters; stores never read a clock
// of their own. A response body is immutable once given
// to a store: a store may keep the Response.Body given to Complete (or
// Unit.Complete) as it is, and return those very bytes from Claim and Get to
// every caller, so neither the caller that gave them nor one that got them
// may modify them (the middleware never does).
type Store interface {
	// Claim atomically decides who runs a request and says what it did.
	// With no record (or a completed one out of the replay window:
	// CompletedAt < Now - ReplayWindow, strictly) it creates an
	// in-progress record owned by c.Owner with Generation 1 (or the old
	// generation + 1): ClaimCreated. With an in-progress record whose lease
	// has expired (LeaseUntil < Now, strictly: a lease is alive up to and
	// including LeaseUntil) and whose fingerprint and version equal c's, it
	// takes the record over with a conditional update that sets Owner,
	// bumps Generation and keeps RecoveryPoint, RecoveryData and Request:
	// ClaimTakenOver. Otherwise it changes nothing: ClaimExisting. A
	// ReplayWindow of 0 or less never expires a completed record. With
	// c.TakeoverOnly it never creates or restarts a record. Never
	// select-then-insert: one atomic step.
	Claim(ctx context.Context, c Claim) (ClaimResult, error)

	// Get returns the record for the scope, or ErrNotFound.
	Get(ctx context.Context, s Scope) (Record, error)

	// Heartbeat sets the lease's end to until (LeaseUntil = until), keeping
	// the record in progress with its recovery point: a later until extends
	// the lease while the work runs; until = now ends it, so that the next
	// claim after now takes the record over and resumes. ErrLeaseLost if l
	// is not the current owner of an in-progress record.
	Heartbeat(ctx context.Context, l Lease, until time.Time) error

	// Complete stores resp and marks the record completed at now, keeping
	// l's Owner and Generation in the record: they tell, when the answer
	// to a Complete (or to a Unit's Commit) is lost, whose completion the
	// record holds. ErrLeaseLost if l is not the current owner of an
	// in-progress record.
	Complete(ctx context.Context, l Lease, resp Response, now time.Time) error

	// Release deletes an in-progress record so that the next request with the
	// same scope runs again. ErrLeaseLost if l is not the current owner.
	Release(ctx context.Context, l Lease) error

	// SetRecoveryPoint records the last committed phase and its state.
	// ErrLeaseLost if l is not the current owner of an in-progress record.
	SetRecoveryPoint(ctx context.Context, l Lease, point string, data []byte, now time.Time) error
}

// Sweeper is implemented by stores whose records the background jobs can
// list and delete: the Completer lists the abandoned records to resume, the
// Reaper the unfinished ones to report and then deletes the old ones. No
// request and no call of Do uses it. Every store of this module is one; a
// Completer or a Reaper over a store that is not fails each run with an
// error wrapping errors.ErrUnsupported. The concurrency and context rules
// are Store's.
type Sweeper interface {
	// Abandoned lists up to limit in-progress records whose lease expired
	// before now (LeaseUntil < now, strictly), oldest LeaseUntil first (for
	// the completer and the reaper).
	Abandoned(ctx context.Context, now time.Time, limit int) ([]Record, error)

	// DeleteBefore deletes up to limit records last updated before horizon
	// (UpdatedAt < horizon: completed ones, and in-progress ones whose lease
	// also expired before it, LeaseUntil < horizon) and reports how many it
	// deleted.
	DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error)
}

// Transactor is implemented by stores that can commit a handler's own
// writes and the record's in one transaction (sqlstore; memstore, whose
// units apply a handler's memstore.OnCommit writes with the record's). The
// middleware and the phases use it when the store offers it.
type Transactor interface {
	// Begin starts a unit of work for the owner of l. The returned context
	// carries the transaction for the handler (for the SQL store,
	// sqlstore.Tx(ctx) returns the *sql.Tx). ctx lives as long as the unit
	// (a transaction may keep it): the middleware cancels it only when
	// Begin, or the unit's Commit, has not returned within its bound (10
	// s), and either must then return; whether such a Commit applied, the
	// middleware reads from the record.
	Begin(ctx context.Context, l Lease) (Unit, context.Context, error)
}

// Unit is one transaction bound to a lease. Its conditional writes fail with
// ErrLeaseLost when the lease no longer holds; nothing is visible to others
// before Commit. A Unit is used by one goroutine.
//
// The fence: a Unit's writes are conditional on its lease (owner and
// generation of an in-progress record), and a Unit and a takeover of its
// record (a Claim that bumps the generation; or a Release, Complete or
// SetRecoveryPoint of another lease) never both succeed. A store that checks
// the lease at each write (the SQL stores) must hold the record from the
// first conditional write that succeeded until Commit or Rollback (a row
// lock), so that no takeover can succeed in between and the takeover, once
// it runs, sees what the Unit committed (a completed record is never taken
// over). A store that checks the lease at Commit (the memory store) applies
// the Unit's writes under the same lock as that check, and Commit fails with
// ErrLeaseLost, applying nothing, if a takeover came first. The conformance
// suite's UnitRaceWithTakeover checks this.
type Unit interface {
	// SetRecoveryPoint records point and data (the last committed phase and
	// its state) as of now, to apply at Commit. It fails with ErrLeaseLost
	// (wrapped or bare) when the lease no longer owns an in-progress record
	// (a store may report that at Commit instead), with an error after
	// Commit or Rollback, and with the store's own error otherwise. After
	// an ErrLeaseLost the Unit can never commit.
	SetRecoveryPoint(ctx context.Context, point string, data []byte, now time.Time) error
	// Complete stores resp and marks the record completed at now, to apply
	// at Commit, keeping the lease's Owner and Generation as
	// Store.Complete does. Its errors are SetRecoveryPoint's.
	Complete(ctx context.Context, resp Response, now time.Time) error
	// Commit makes every write of the Unit visible at once (the handler's
	// own writes in the same transaction included), or none of them. It
	// fails with ErrLeaseLost when the lease was lost (nothing applied), or
	// with the store's error; then whether it applied is the database's to
	// say (a connection lost after the COMMIT went out), and the middleware
	// reads the record to find out. A second Commit fails.
	Commit() error
	// Rollback discards every write of the Unit. It is safe to call after
	// Commit (then a no-op that does not undo it) and more than once; its
	// error is the store's, for logging only.
	Rollback() error
}

// ClaimTransactor is implemented by stores that can claim a fresh key
// inside the transaction that completes it (sqlstore), for the routes of
// a Middleware made WithOneTransaction(true): the claim, the handler's
// writes in the unit and the completion then commit at once, or not at
// all. It is optional, as Transactor is; the concurrency and context
// rules are Transactor's.
type ClaimTransactor interface {
	// ClaimInUnit begins a unit of work and, in it, creates c's record
	// when the scope has none: then the result is ClaimCreated (its Record
	// as Claim gives it) with the Unit, whose Complete and Commit complete
	// the record and whose Rollback leaves no trace of it, and a context
	// that carries the transaction (as Begin's does). Until Commit nobody
	// else sees the record: a claim of the same scope by another caller
	// waits for the unit to end, and then finds the completed record or
	// none. ctx lives as long as the unit, as for Begin.
	//
	// With a record already there, ClaimInUnit ends the unit and returns
	// a nil Unit: ClaimExisting with the record when c would not win it
	// (Claim's answer), or ClaimExisting with a zero Record (State Absent)
	// when the caller is to claim the ordinary way (Store.Claim): the
	// record is one c would take over or restart, or it vanished
	// meanwhile. When another caller's unit holds the scope past wait
	// (a store may wait longer, as its documentation says), the error
	// matches ErrInProgress; any other error means nothing was claimed.
	// c.TakeoverOnly is not used: the caller claims such a claim with
	// Store.Claim.
	ClaimInUnit(ctx context.Context, c Claim, wait time.Duration) (ClaimResult, Unit,
		context.Context, error)
}
