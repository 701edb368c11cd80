package linearizability

import (
	"fmt"
	"hash/fnv"
	"math"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/saferetry/saferetry/idempotency"
)

// The sequential specification of one record (one Scope), as the Store
// contract in package idempotency states it: absent, then in progress
// (owner, generation, lease), then completed; a claim takes over an
// in-progress record whose lease ended before its Now (strictly) with the
// same fingerprint, bumping the generation; a claim past the replay window
// restarts a completed record with the next generation; every write is
// fenced on owner and generation and fails with ErrLeaseLost otherwise.
// Time is the operations' own: a claim's Now, a write's now or until, never
// a clock of the store's.

// opKind names a Store method.
type opKind uint8

const (
	opClaim opKind = iota + 1
	opGet
	opHeartbeat
	opComplete
	opRelease
	opSetPoint
	// opClaimTx is a request on a route that commits in one transaction
	// (idempotency.ClaimTransactor): ClaimInUnit, then, when it holds the
	// record, the unit's Complete at Now and Commit (or Rollback): one
	// step, at the commit.
	opClaimTx
)

func (k opKind) String() string {
	switch k {
	case opClaim:
		return "claim"
	case opGet:
		return "get"
	case opHeartbeat:
		return "heartbeat"
	case opComplete:
		return "complete"
	case opRelease:
		return "release"
	case opSetPoint:
		return "set_recovery_point"
	case opClaimTx:
		return "claim_in_unit"
	}
	return "unknown"
}

// response is a stored response in a comparable form: the header is
// canonical (see headerString).
type response struct {
	Status int    `json:"status,omitempty"`
	Header string `json:"header,omitempty"`
	Body   string `json:"body,omitempty"`
}

// input is one Store call. Times are Unix nanoseconds.
type input struct {
	Op  opKind `json:"op"`
	Key string `json:"key"` // Scope.Key: the partition

	Owner string `json:"owner,omitempty"` // Claim.Owner, or the Lease's
	Gen   int64  `json:"gen,omitempty"`   // the Lease's generation (writes)

	Now          int64  `json:"now,omitempty"`    // Claim.Now; the now of the writes that take one
	Until        int64  `json:"until,omitempty"`  // Heartbeat
	LeaseFor     int64  `json:"lease,omitempty"`  // Claim.LeaseFor
	Window       int64  `json:"window,omitempty"` // Claim.ReplayWindow
	FP           string `json:"fp,omitempty"`     // Claim.Fingerprint (version 1)
	TakeoverOnly bool   `json:"tko,omitempty"`
	Request      string `json:"req,omitempty"`

	Point string   `json:"point,omitempty"` // SetRecoveryPoint
	Data  string   `json:"data,omitempty"`
	Resp  response `json:"resp,omitzero"` // Complete, and opClaimTx's completion

	Commit bool `json:"commit,omitempty"` // opClaimTx: commit the unit (else roll it back)
}

// errKind is the outcome class of a call that returned.
type errKind uint8

const (
	errNone      errKind = iota
	errNotFound          // idempotency.ErrNotFound
	errLeaseLost         // idempotency.ErrLeaseLost
	errOther             // anything else (the call is then recorded as unknown)
)

func (e errKind) String() string {
	return [...]string{"ok", "not_found", "lease_lost", "error"}[e]
}

// view is what a store returned of a record, in a comparable form. Times are
// Unix nanoseconds, 0 for the zero time.
type view struct {
	ScopeOK     bool              `json:"scope_ok,omitempty"` // its Scope is the one asked for
	State       idempotency.State `json:"state,omitempty"`
	Owner       string            `json:"owner,omitempty"`
	Gen         int64             `json:"gen,omitempty"`
	FP          string            `json:"fp,omitempty"`
	FPV         int               `json:"fpv,omitempty"`
	LeaseUntil  int64             `json:"lease_until,omitempty"`
	CreatedAt   int64             `json:"created,omitempty"`
	CompletedAt int64             `json:"completed,omitempty"`
	Point       string            `json:"point,omitempty"`
	Data        string            `json:"data,omitempty"`
	Request     string            `json:"req,omitempty"`
	HasResp     bool              `json:"has_resp,omitempty"`
	Resp        response          `json:"resp,omitzero"`
}

// output is what a call returned. An unknown output is a call whose outcome
// the history cannot know: it never returned (its process was killed), or it
// failed with an error other than ErrNotFound and ErrLeaseLost (a connection
// killed mid-call, a timeout), after which the store may or may not have
// applied it. Such an operation's Return is math.MaxInt64: porcupine may
// linearize it at any point after its call, including after everything else
// (where it changes nothing anyone observed), which is exactly "it may or may
// not have happened".
type output struct {
	Unknown bool                     `json:"unknown,omitempty"`
	Err     errKind                  `json:"err,omitempty"`
	Outcome idempotency.ClaimOutcome `json:"outcome,omitempty"`
	Rec     view                     `json:"rec,omitzero"`
	// Upper bounds the Now of every claim linearized before this call
	// returned (for a model whose store evicts expired records on its own;
	// math.MaxInt64 when unknown).
	Upper int64 `json:"upper,omitempty"`
}

// record is the model's state of one scope. The zero value is absent.
type record struct {
	State       idempotency.State
	Owner       string
	Gen         int64
	FP          string
	LeaseUntil  int64
	CreatedAt   int64
	CompletedAt int64
	Window      int64 // the ReplayWindow of the claim that created it
	Point       string
	Data        string
	Request     string
	Resp        response
}

// model is the porcupine model of one record, partitioned by key.
type model struct {
	// evicts: the store may delete a completed record on its own once it
	// is past the replay window of the claim that created it (CompletedAt
	// + window < a later claim's Now, strictly), so that a later claim
	// creates it afresh with generation 1 (memstore evicts such records at
	// any claim that creates one, of any scope).
	evicts bool
	epoch  int64 // for descriptions: times are shown relative to it, in ms
}

// fingerprintVersion is the FingerprintVersion of every claim.
const fingerprintVersion = 1

func (m model) porcupine() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: partitionByKey,
		Init:      func() []any { return []any{record{}} },
		Step: func(state, in, out any) []any {
			next := m.step(state.(record), in.(input), out.(output))
			states := make([]any, len(next))
			for i, r := range next {
				states[i] = r
			}
			return states
		},
		Equal:             func(a, b any) bool { return a.(record) == b.(record) },
		Hash:              func(s any) uint64 { return s.(record).hash() },
		DescribeOperation: func(in, out any) string { return m.describeOp(in.(input), out.(output)) },
		DescribeState:     func(s any) string { return m.describeRecord(s.(record)) },
	}
	return nm.ToModel()
}

func partitionByKey(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range history {
		k := op.Input.(input).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	out := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		out = append(out, byKey[k])
	}
	return out
}

// step returns the states the record can be in after the call in returned
// out from state s: none when out is impossible.
func (m model) step(s record, in input, out output) []record {
	cands := []record{s}
	if m.evicts && s.State == idempotency.Completed && s.Window > 0 &&
		s.CompletedAt+s.Window < out.upper() {
		cands = append(cands, record{})
	}
	var next []record
	for _, c := range cands {
		n, want := apply(c, in)
		if out.Unknown || matches(in, want, out) {
			next = append(next, n)
		}
	}
	return next
}

func (o output) upper() int64 {
	if o.Unknown {
		return math.MaxInt64
	}
	return o.Upper
}

// apply runs in on s: the next state and the output the contract requires
// (an in-progress or completed record's view in full; matches compares the
// fields that the outcome requires).
func apply(s record, in input) (record, output) {
	switch in.Op {
	case opClaim:
		return claim(s, in)
	case opClaimTx:
		return claimTx(s, in)
	case opGet:
		if s.State == idempotency.Absent {
			return s, output{Err: errNotFound}
		}
		return s, output{Rec: s.view()}
	}
	if s.State != idempotency.InProgress || s.Owner != in.Owner || s.Gen != in.Gen {
		return s, output{Err: errLeaseLost}
	}
	n := s
	switch in.Op {
	case opHeartbeat:
		n.LeaseUntil = in.Until
	case opComplete:
		n.State, n.CompletedAt, n.Resp, n.Request = idempotency.Completed, in.Now, in.Resp, ""
	case opRelease:
		n = record{}
	case opSetPoint:
		n.Point, n.Data = in.Point, in.Data
	}
	return n, output{}
}

func claim(s record, in input) (record, output) {
	fresh := func(gen int64) record {
		return record{
			State: idempotency.InProgress, Owner: in.Owner, Gen: gen, FP: in.FP,
			LeaseUntil: in.Now + in.LeaseFor, CreatedAt: in.Now, Window: in.Window,
			Request: in.Request,
		}
	}
	switch {
	case s.State == idempotency.Absent && in.TakeoverOnly:
		return s, output{Outcome: idempotency.ClaimExisting}
	case s.State == idempotency.Absent:
		n := fresh(1)
		return n, output{Outcome: idempotency.ClaimCreated, Rec: n.view()}
	case s.State == idempotency.InProgress && s.LeaseUntil < in.Now && s.FP == in.FP:
		n := s
		n.Owner, n.Gen, n.LeaseUntil = in.Owner, s.Gen+1, in.Now+in.LeaseFor
		return n, output{Outcome: idempotency.ClaimTakenOver, Rec: n.view()}
	case s.State == idempotency.Completed && !in.TakeoverOnly && in.Window > 0 &&
		s.CompletedAt < in.Now-in.Window:
		n := fresh(s.Gen + 1)
		return n, output{Outcome: idempotency.ClaimCreated, Rec: n.view()}
	}
	return s, output{Outcome: idempotency.ClaimExisting, Rec: s.view()}
}

// claimTx is opClaimTx: on an absent record, the claim creates it and the
// unit completes it with in.Resp at in.Now, both at the commit (or
// neither, rolled back), and the answer is the created record; on any
// other, the answer is Claim's existing one and nothing changes (a record
// the claim would win answers a zero Record too, see matches).
func claimTx(s record, in input) (record, output) {
	if s.State != idempotency.Absent {
		return s, output{Outcome: idempotency.ClaimExisting, Rec: s.view()}
	}
	n := record{
		State: idempotency.InProgress, Owner: in.Owner, Gen: 1, FP: in.FP,
		LeaseUntil: in.Now + in.LeaseFor, CreatedAt: in.Now, Window: in.Window,
		Request: in.Request,
	}
	out := output{Outcome: idempotency.ClaimCreated, Rec: n.view()}
	if !in.Commit {
		return s, out
	}
	n.State, n.CompletedAt, n.Resp, n.Request = idempotency.Completed, in.Now, in.Resp, ""
	return n, out
}

func (r record) view() view {
	v := view{
		ScopeOK: true, State: r.State, Owner: r.Owner, Gen: r.Gen, FP: r.FP,
		FPV: fingerprintVersion, LeaseUntil: r.LeaseUntil, CreatedAt: r.CreatedAt,
		Point: r.Point, Data: r.Data, Request: r.Request,
	}
	if r.State == idempotency.Completed {
		v.CompletedAt, v.HasResp, v.Resp = r.CompletedAt, true, r.Resp
	}
	return v
}

// matches reports whether got is what the contract allows for in, given the
// output want that the model computed: the fields the contract sets for
// each outcome (idempotency.ClaimOutcome, Store.Get) must be equal.
func matches(in input, want, got output) bool {
	if got.Err != want.Err {
		return false
	}
	switch in.Op {
	case opClaim:
		return got.Outcome == want.Outcome && claimMatches(in, want.Outcome, want.Rec, got.Rec)
	case opClaimTx:
		if got.Outcome == idempotency.ClaimExisting && got.Rec.State == idempotency.Absent {
			// A zero Record: the caller is to claim the ordinary way. The
			// contract allows it for a record the claim would win, and
			// for one that vanished between the store's statements; the
			// check allows it from any state, where it changes nothing.
			return true
		}
		return got.Outcome == want.Outcome && claimMatches(in, want.Outcome, want.Rec, got.Rec)
	case opGet:
		return want.Err != errNone || getMatches(want.Rec, got.Rec)
	}
	return true
}

// lease compares what every returned record carries: scope, state,
// fingerprint and version, owner, generation and lease.
func leaseMatches(w, g view) bool {
	return g.ScopeOK && g.State == w.State && g.FP == w.FP && g.FPV == w.FPV &&
		g.Owner == w.Owner && g.Gen == w.Gen && g.LeaseUntil == w.LeaseUntil
}

func claimMatches(in input, outcome idempotency.ClaimOutcome, w, g view) bool {
	switch outcome {
	case idempotency.ClaimCreated:
		// Request may be left zero (it is the claim's own).
		return leaseMatches(w, g) && g.CreatedAt == w.CreatedAt && g.Point == "" &&
			g.Data == "" && !g.HasResp && (g.Request == "" || g.Request == in.Request)
	case idempotency.ClaimTakenOver:
		return leaseMatches(w, g) && g.CreatedAt == w.CreatedAt && g.Point == w.Point &&
			g.Data == w.Data && g.Request == w.Request && !g.HasResp
	}
	if w.State == idempotency.Absent { // TakeoverOnly, no record: a zero Record
		return g.State == idempotency.Absent && g.Gen == 0 && g.Owner == ""
	}
	if !leaseMatches(w, g) {
		return false
	}
	if w.State == idempotency.Completed {
		return g.CompletedAt == w.CompletedAt && g.HasResp && g.Resp == w.Resp
	}
	return true
}

func getMatches(w, g view) bool {
	if !leaseMatches(w, g) || g.CreatedAt != w.CreatedAt {
		return false
	}
	if w.State == idempotency.Completed {
		// A store may drop the request, recovery point and data at
		// completion.
		return g.CompletedAt == w.CompletedAt && g.HasResp && g.Resp == w.Resp
	}
	return g.Point == w.Point && g.Data == w.Data && g.Request == w.Request && !g.HasResp
}

func (r record) hash() uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d|%s|%d|%d|%d|%s", r.State, r.Owner, r.Gen, r.LeaseUntil, r.CompletedAt, r.Point)
	return h.Sum64()
}

// ms shows a time relative to the model's epoch, in milliseconds.
func (m model) ms(t int64) string {
	if t == 0 {
		return "0"
	}
	return fmt.Sprintf("%+d", (t-m.epoch)/int64(time.Millisecond))
}

func (m model) dur(d int64) string { return fmt.Sprint(d / int64(time.Millisecond)) }

func (m model) describeRecord(r record) string {
	switch r.State {
	case idempotency.InProgress:
		return fmt.Sprintf("in_progress %s/g%d fp=%s lease<=%s point=%q created=%s",
			r.Owner, r.Gen, r.FP, m.ms(r.LeaseUntil), r.Point, m.ms(r.CreatedAt))
	case idempotency.Completed:
		return fmt.Sprintf("completed %s/g%d at %s status=%d",
			r.Owner, r.Gen, m.ms(r.CompletedAt), r.Resp.Status)
	}
	return "absent"
}

func (m model) describeView(v view) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s/g%d fp=%s lease<=%s", v.State, v.Owner, v.Gen, v.FP, m.ms(v.LeaseUntil))
	if v.CreatedAt != 0 {
		fmt.Fprintf(&b, " created=%s", m.ms(v.CreatedAt))
	}
	if v.Point != "" {
		fmt.Fprintf(&b, " point=%q", v.Point)
	}
	if v.HasResp {
		fmt.Fprintf(&b, " completed=%s status=%d", m.ms(v.CompletedAt), v.Resp.Status)
	}
	if !v.ScopeOK {
		b.WriteString(" WRONG-SCOPE")
	}
	return b.String()
}

func (m model) describeOp(in input, out output) string {
	var call string
	switch in.Op {
	case opClaim:
		call = fmt.Sprintf("claim(%s now=%s lease=%s fp=%s",
			in.Owner, m.ms(in.Now), m.dur(in.LeaseFor), in.FP)
		if in.TakeoverOnly {
			call += " takeover-only"
		}
		call += ")"
	case opGet:
		call = "get()"
	case opHeartbeat:
		call = fmt.Sprintf("heartbeat(%s/g%d until=%s)", in.Owner, in.Gen, m.ms(in.Until))
	case opComplete:
		call = fmt.Sprintf("%s(%s/g%d now=%s)", in.Op, in.Owner, in.Gen, m.ms(in.Now))
	case opRelease:
		call = fmt.Sprintf("release(%s/g%d)", in.Owner, in.Gen)
	case opSetPoint:
		call = fmt.Sprintf("set_recovery_point(%s/g%d %q)", in.Owner, in.Gen, in.Point)
	case opClaimTx:
		call = fmt.Sprintf("claim_in_unit(%s now=%s lease=%s fp=%s commit=%t)",
			in.Owner, m.ms(in.Now), m.dur(in.LeaseFor), in.FP, in.Commit)
	}
	switch {
	case out.Unknown:
		return call + " -> unknown"
	case out.Err != errNone:
		return call + " -> " + out.Err.String()
	case in.Op == opClaim || in.Op == opClaimTx:
		if out.Outcome == idempotency.ClaimExisting && out.Rec.State == idempotency.Absent {
			return call + " -> existing (none)"
		}
		return call + " -> " + out.Outcome.String() + " " + m.describeView(out.Rec)
	case in.Op == opGet:
		return call + " -> " + m.describeView(out.Rec)
	}
	return call + " -> ok"
}
