package memstore

import (
	"bytes"
	"context"
	"errors"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

var errUnitDone = errors.New("memstore: unit already committed or rolled back")

// Begin implements idempotency.Transactor.Begin. The returned context is ctx: the memory
// store has no transaction handle of its own to carry.
func (m *Store) Begin(ctx context.Context, l idempotency.Lease) (idempotency.Unit, context.Context, error) {
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

func (u *memoryUnit) SetRecoveryPoint(_ context.Context, point string, data []byte, now time.Time) error {
	return u.add(memoryOp{point: point, data: bytes.Clone(data), now: now})
}

func (u *memoryUnit) Complete(_ context.Context, resp idempotency.Response, now time.Time) error {
	op := memoryOp{now: now}
	op.resp.keep(&resp)
	return u.add(op)
}

// OnCommit registers f to run under the store's lock at a successful Commit.
func (u *memoryUnit) OnCommit(f func()) {
	if !u.done && f != nil {
		u.hooks = append(u.hooks, f)
	}
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
			u.m.settle(rec, op.resp, op.now)
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
