package memstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

var errUnitDone = errors.New("memstore: unit already committed or rolled back")

// Begin implements idempotency.Transactor.Begin. The returned context is ctx: the memory
// store has no transaction handle of its own to carry.
func (m *Store) Begin(ctx context.Context, l idempotency.Lease) (
	idempotency.Unit, context.Context, error) {
	if err := ctx.Err(); err != nil {
		return nil, ctx, err
	}
	return &memoryUnit{m: m, lease: l}, ctx, nil
}

type memoryUnit struct {
	m      *Store
	lease  idempotency.Lease
	done   bool
	ops    []memoryOp // applied in order at Commit
	inline [2]memoryOp
	hooks  []func()
}

// memoryOp is one buffered write of a unit: a completion with resp (the
// unit's own copy, kept as the store keeps it) when resp.set, or else a
// recovery point.
type memoryOp struct {
	resp  memResponse
	point string
	data  []byte
	now   time.Time
}

func (u *memoryUnit) add(op memoryOp) error {
	if u.done {
		return errUnitDone
	}
	if u.ops == nil {
		u.ops = u.inline[:0] // most units write once or twice
	}
	u.ops = append(u.ops, op)
	return nil
}

func (u *memoryUnit) SetRecoveryPoint(_ context.Context, point string, data []byte,
	now time.Time) error {
	return u.add(memoryOp{point: point, data: bytes.Clone(data), now: now})
}

func (u *memoryUnit) Complete(_ context.Context, resp idempotency.Response, now time.Time) error {
	op := memoryOp{now: now}
	op.resp.keep(&resp)
	return u.add(op)
}

// OnCommit registers f to run at a successful Commit of u, a unit of a
// Store's (Run.Unit, or the unit of a phase), under the Store's lock, so
// that a handler's own in-memory writes take effect with the record's, or
// not at all. f must be fast and must not call the Store. It fails with an
// error wrapping errors.ErrUnsupported when u is not a Store's unit (nil
// included), and with one when u was already committed or rolled back. A
// nil f is no hook.
func OnCommit(u idempotency.Unit, f func()) error {
	mu, ok := u.(*memoryUnit)
	switch {
	case !ok:
		return fmt.Errorf("memstore: OnCommit: the unit (%T) is not a memory Store's: %w",
			u, errors.ErrUnsupported)
	case mu.done:
		return errUnitDone
	case f != nil:
		mu.hooks = append(mu.hooks, f)
	}
	return nil
}

func (u *memoryUnit) Commit() error {
	if u.done {
		return errUnitDone
	}
	u.done = true
	u.m.mu.Lock()
	defer u.m.mu.Unlock()
	rec, err := u.m.owned(u.lease)
	if err != nil {
		return err
	}
	for _, op := range u.ops {
		if op.resp.set {
			u.m.completeRecord(rec, op.resp, op.now)
		} else {
			u.m.setPoint(rec, op.point, op.data, op.now)
		}
	}
	for _, f := range u.hooks {
		f()
	}
	return nil
}

func (u *memoryUnit) Rollback() error {
	u.done = true
	u.ops, u.hooks = nil, nil
	return nil
}
