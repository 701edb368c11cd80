package linearizability

import (
	"context"
	"errors"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/saferetry/saferetry/idempotency"
)

// clock is the logical time of one run: every call takes the next tick, and
// a worker's Now is epoch + (tick + its skew) * unit. Time advances with the
// calls, not with real time, so leases expire after a number of calls
// whatever the store's speed, and no test sleeps to let a lease run out.
type clock struct {
	epoch int64 // Unix nanoseconds
	unit  int64 // nanoseconds per tick
	tick  atomic.Int64
}

// newClock starts at the current wall time, so that a store that also
// expires records by its own clock at a far horizon (Redis' PEXPIREAT)
// keeps them.
func newClock() *clock {
	return &clock{epoch: time.Now().Truncate(time.Second).UnixNano(), unit: int64(time.Millisecond)}
}

func (c *clock) at(tick int64) int64 { return c.epoch + tick*c.unit }

// sink records calls and their returns.
type sink interface {
	begin(client int, in input) any // records the call, just before it is made
	end(call any, out output)       // records its return, just after
}

// history is the sink of one process: porcupine operations, with call and
// return times from the shared monotonic clock.
type history struct {
	mu  sync.Mutex
	ops []porcupine.Operation
}

type pending struct {
	client int
	in     input
	call   int64
}

func (h *history) begin(client int, in input) any {
	return pending{client: client, in: in, call: monotonic()}
}

func (h *history) end(c any, out output) {
	p := c.(pending)
	ret := monotonic()
	if out.Unknown {
		ret = math.MaxInt64
	}
	h.add(porcupine.Operation{ClientId: p.client, Input: p.in, Call: p.call, Output: out, Return: ret})
}

func (h *history) add(ops ...porcupine.Operation) {
	h.mu.Lock()
	h.ops = append(h.ops, ops...)
	h.mu.Unlock()
}

func (h *history) operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ops)
}

// caller makes the calls of a history on one store, for one principal.
type caller struct {
	store     idempotency.Store
	principal string
}

func (c caller) scope(key string) idempotency.Scope {
	return idempotency.Scope{Principal: c.principal, Method: http.MethodPost, Route: "/lin", Key: key}
}

func (c caller) lease(in input) idempotency.Lease {
	return idempotency.Lease{Scope: c.scope(in.Key), Owner: in.Owner, Generation: in.Gen}
}

func at(n int64) time.Time { return time.Unix(0, n).UTC() }

// do makes the call in and says what it returned (without Upper), and the
// error that left its outcome unknown.
func (c caller) do(ctx context.Context, in input) (output, error) {
	out, err := c.call(ctx, in)
	if !out.Unknown {
		err = nil
	}
	return out, err
}

func (c caller) call(ctx context.Context, in input) (output, error) {
	var err error
	switch in.Op {
	case opClaim:
		res, err := c.store.Claim(ctx, idempotency.Claim{
			Scope: c.scope(in.Key), Fingerprint: in.FP, FingerprintVersion: fingerprintVersion,
			Owner: in.Owner, Request: bytesOf(in.Request), Now: at(in.Now),
			LeaseFor: time.Duration(in.LeaseFor), ReplayWindow: time.Duration(in.Window),
			TakeoverOnly: in.TakeoverOnly,
		})
		if err != nil {
			return errorOutput(err), err
		}
		return output{Outcome: res.Outcome, Rec: c.view(in.Key, res.Record)}, nil
	case opClaimTx:
		return c.claimTx(ctx, in)
	case opGet:
		rec, err := c.store.Get(ctx, c.scope(in.Key))
		if err != nil {
			return errorOutput(err), err
		}
		return output{Rec: c.view(in.Key, rec)}, nil
	case opHeartbeat:
		err = c.store.Heartbeat(ctx, c.lease(in), at(in.Until))
	case opComplete:
		err = c.store.Complete(ctx, c.lease(in), storedResponse(in), at(in.Now))
	case opRelease:
		err = c.store.Release(ctx, c.lease(in))
	case opSetPoint:
		err = c.store.SetRecoveryPoint(ctx, c.lease(in), in.Point, bytesOf(in.Data), at(in.Now))
	}
	return errorOutput(err), err
}

// claimTx makes an opClaimTx call: ClaimInUnit, then, when it holds the
// record, the unit's Complete and Commit, or its Rollback. An error after
// the claim (the unit's or its Commit's) leaves the outcome unknown, as
// does the claim's ErrInProgress: another call's unit held the key, and
// this one changed nothing.
func (c caller) claimTx(ctx context.Context, in input) (output, error) {
	ct, ok := c.store.(idempotency.ClaimTransactor)
	if !ok {
		err := errors.New("the store is not an idempotency.ClaimTransactor")
		return errorOutput(err), err
	}
	res, u, _, err := ct.ClaimInUnit(ctx, idempotency.Claim{
		Scope: c.scope(in.Key), Fingerprint: in.FP, FingerprintVersion: fingerprintVersion,
		Owner: in.Owner, Request: bytesOf(in.Request), Now: at(in.Now),
		LeaseFor: time.Duration(in.LeaseFor), ReplayWindow: time.Duration(in.Window),
	}, 0)
	if err != nil {
		return errorOutput(err), err
	}
	out := output{Outcome: res.Outcome, Rec: c.view(in.Key, res.Record)}
	if u == nil {
		return out, nil
	}
	if !in.Commit {
		if err := u.Rollback(); err != nil {
			return errorOutput(err), err
		}
		return out, nil
	}
	if err := u.Complete(ctx, storedResponse(in), at(in.Now)); err != nil {
		_ = u.Rollback()
		return output{Err: errOther, Unknown: true}, err
	}
	if err := u.Commit(); err != nil {
		return output{Err: errOther, Unknown: true}, err
	}
	return out, nil
}

// storedResponse is the response in.Resp stands for.
func storedResponse(in input) idempotency.Response {
	resp := idempotency.Response{
		Status: in.Resp.Status, Header: http.Header{}, Body: bytesOf(in.Resp.Body)}
	if in.Resp.Header != "" {
		resp.Header.Set(leaseHeader, in.Resp.Header)
	}
	return resp
}

// leaseHeader is the one header of a stored response: the lease that
// completed it.
const leaseHeader = "X-Lease"

func bytesOf(s string) []byte {
	if s == "" {
		return nil
	}
	return []byte(s)
}

// errorOutput classifies err: nil, ErrNotFound and ErrLeaseLost are
// answers; any other error leaves the outcome unknown.
func errorOutput(err error) output {
	switch {
	case err == nil:
		return output{}
	case errors.Is(err, idempotency.ErrNotFound):
		return output{Err: errNotFound}
	case errors.Is(err, idempotency.ErrLeaseLost):
		return output{Err: errLeaseLost}
	}
	return output{Err: errOther, Unknown: true}
}

func nanosOf(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func (c caller) view(key string, r idempotency.Record) view {
	v := view{
		ScopeOK: r.Scope == c.scope(key), State: r.State, Owner: r.Owner, Gen: r.Generation,
		FP: r.Fingerprint, FPV: r.FingerprintVersion, LeaseUntil: nanosOf(r.LeaseUntil),
		CreatedAt: nanosOf(r.CreatedAt), CompletedAt: nanosOf(r.CompletedAt),
		Point: r.RecoveryPoint, Data: string(r.RecoveryData), Request: string(r.Request),
	}
	if r.Response != nil {
		v.HasResp = true
		v.Resp = response{Status: r.Response.Status, Header: headerString(r.Response.Header),
			Body: string(r.Response.Body)}
	}
	return v
}

// headerString is h in a canonical, comparable form. A response whose only
// header is X-Lease: v gives v.
func headerString(h http.Header) string {
	if len(h) == 1 && len(h[leaseHeader]) == 1 {
		return h.Get(leaseHeader)
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(h)) {
		b.WriteString(k + ":" + strings.Join(h[k], ",") + ";")
	}
	return b.String()
}
