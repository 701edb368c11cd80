package idempotency

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"
)

// ErrUnitDone is returned by a MemoryStore Unit used after Commit or
// Rollback.
var ErrUnitDone = errors.New("idempotency: unit already committed or rolled back")

// MemoryStore is a Store and Transactor that keeps records in process
// memory, for tests and single-process servers: records do not survive a
// restart and are not shared between processes. The zero value is not
// usable; call NewMemoryStore. Safe for concurrent use; every operation
// takes one mutex, so claims are atomic. The store copies what it is given
// and what it returns: records share no memory with the store.
type MemoryStore struct {
	mu      sync.Mutex
	records map[Scope]*memRecord
}

// memRecord is a record as the MemoryStore keeps it: its Response is always
// nil, and resp holds the response in a flat form.
type memRecord struct {
	Record
	resp memResponse
}

// memResponse is a stored response as the MemoryStore keeps it, with the
// header as one list of name, value pairs instead of a map: a map of one
// header costs about 400 bytes in three allocations, the list 32 bytes in
// one, and a store keeps a replay window's worth of responses.
type memResponse struct {
	set    bool // the record has a response
	status int
	pairs  []string    // name, value, name, value...: a name's values in a row; nil for a nil Header
	odd    http.Header // instead of pairs, a copy of a Header that has a name without values
	body   []byte
}

// keep sets the response to a copy of resp: a copy of its body, and of its
// header only the strings, never a slice or map of the caller's.
func (r *memResponse) keep(resp *Response) {
	*r = memResponse{set: true, status: resp.Status, body: bytes.Clone(resp.Body)}
	if resp.Header == nil {
		return
	}
	n := 0
	for _, v := range resp.Header {
		if len(v) == 0 {
			r.odd = resp.Header.Clone() // pairs cannot say "no values"
			return
		}
		n += len(v)
	}
	r.pairs = make([]string, 0, 2*n) // not nil, even when empty
	for k, vs := range resp.Header {
		for _, v := range vs {
			r.pairs = append(r.pairs, k, v)
		}
	}
}

// response returns a copy of the response (as Header.Clone and
// bytes.Clone copy), or nil when there is none.
func (r *memResponse) response() *Response {
	if !r.set {
		return nil
	}
	out := &Response{Status: r.status, Body: bytes.Clone(r.body), Header: r.odd.Clone()}
	if r.pairs != nil {
		sv := make([]string, len(r.pairs)/2) // one backing array for every value
		out.Header = make(http.Header, len(sv))
		for i := 0; i < len(r.pairs); {
			name, first := r.pairs[i], i/2
			for ; i < len(r.pairs) && r.pairs[i] == name; i += 2 {
				sv[i/2] = r.pairs[i+1]
			}
			out.Header[name] = sv[first : i/2 : i/2]
		}
	}
	return out
}

// NewMemoryStore returns an empty MemoryStore.
//
// Its Units (Begin) buffer SetRecoveryPoint and Complete and apply them
// atomically under the store's lock at Commit, which fails with ErrLeaseLost
// (applying nothing) if the lease's owner or generation no longer match an
// in-progress record. A Unit also has a method OnCommit(f func()) (reach it
// with a type assertion to interface{ OnCommit(func()) }) that registers f to
// run under the store's lock at a successful Commit: a handler can apply its
// own in-memory writes there, so that they commit together with the record.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{records: make(map[Scope]*memRecord)}
}

var (
	_ Store      = (*MemoryStore)(nil)
	_ Transactor = (*MemoryStore)(nil)
)

func cloneRecord(r *memRecord) Record {
	c := r.Record
	c.RecoveryData = bytes.Clone(r.RecoveryData)
	c.Request = bytes.Clone(r.Request)
	c.Response = r.resp.response()
	return c
}

// Claim implements Store.Claim. It honours ctx only before taking the lock.
func (m *MemoryStore) Claim(ctx context.Context, c Claim) (Record, bool, error) {
	if err := ctx.Err(); err != nil {
		return Record{}, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[c.Scope]
	if !ok && c.TakeoverOnly {
		return Record{}, false, nil
	}
	gen := int64(1)
	if ok {
		switch {
		case rec.State == Completed && !c.TakeoverOnly && c.ReplayWindow > 0 && c.Now.Sub(rec.CompletedAt) > c.ReplayWindow:
			gen = rec.Generation + 1 // out of the replay window: a new request
		case rec.State == InProgress && rec.LeaseUntil.Before(c.Now) && rec.Fingerprint == c.Fingerprint &&
			rec.FingerprintVersion == c.FingerprintVersion:
			rec.Owner = c.Owner
			rec.Generation++
			rec.LeaseUntil = c.Now.Add(c.LeaseFor)
			rec.UpdatedAt = c.Now
			return cloneRecord(rec), true, nil
		default:
			return cloneRecord(rec), false, nil
		}
	}
	rec = &memRecord{Record: Record{
		Scope:              c.Scope,
		State:              InProgress,
		Fingerprint:        c.Fingerprint,
		FingerprintVersion: c.FingerprintVersion,
		Owner:              c.Owner,
		Generation:         gen,
		LeaseUntil:         c.Now.Add(c.LeaseFor),
		Request:            bytes.Clone(c.Request),
		CreatedAt:          c.Now,
		UpdatedAt:          c.Now,
	}}
	m.records[c.Scope] = rec
	return cloneRecord(rec), true, nil
}

// Get implements Store.Get.
func (m *MemoryStore) Get(ctx context.Context, s Scope) (Record, error) {
	if err := ctx.Err(); err != nil {
		return Record{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[s]
	if !ok {
		return Record{}, ErrNotFound
	}
	return cloneRecord(rec), nil
}

// owned returns the in-progress record that l owns; m.mu must be held.
func (m *MemoryStore) owned(l Lease) (*memRecord, error) {
	rec, ok := m.records[l.Scope]
	if !ok || rec.State != InProgress || rec.Owner != l.Owner || rec.Generation != l.Generation {
		return nil, ErrLeaseLost
	}
	return rec, nil
}

// fenced runs write on the in-progress record that l owns, under the lock:
// the one fence that every conditional write of the store goes through.
func (m *MemoryStore) fenced(ctx context.Context, l Lease, write func(rec *memRecord)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, err := m.owned(l)
	if err != nil {
		return err
	}
	write(rec)
	return nil
}

// Heartbeat implements Store.Heartbeat.
func (m *MemoryStore) Heartbeat(ctx context.Context, l Lease, until time.Time) error {
	return m.fenced(ctx, l, func(rec *memRecord) { rec.LeaseUntil = until })
}

// Complete implements Store.Complete.
func (m *MemoryStore) Complete(ctx context.Context, l Lease, resp Response, now time.Time) error {
	return m.fenced(ctx, l, func(rec *memRecord) { complete(rec, &resp, now) })
}

// complete settles rec with a copy of resp.
func complete(rec *memRecord, resp *Response, now time.Time) {
	rec.State = Completed
	rec.resp.keep(resp)
	rec.CompletedAt = now
	rec.UpdatedAt = now
}

// Release implements Store.Release.
func (m *MemoryStore) Release(ctx context.Context, l Lease) error {
	return m.fenced(ctx, l, func(*memRecord) { delete(m.records, l.Scope) })
}

// SetRecoveryPoint implements Store.SetRecoveryPoint.
func (m *MemoryStore) SetRecoveryPoint(ctx context.Context, l Lease, point string, data []byte, now time.Time) error {
	return m.fenced(ctx, l, func(rec *memRecord) {
		rec.RecoveryPoint, rec.RecoveryData, rec.UpdatedAt = point, bytes.Clone(data), now
	})
}

// Abandoned implements Store.Abandoned: in-progress records whose lease
// ended before now (LeaseUntil < now, strictly), ordered by LeaseUntil, then
// CreatedAt. A limit <= 0 returns nothing.
func (m *MemoryStore) Abandoned(ctx context.Context, now time.Time, limit int) ([]Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*memRecord
	for _, rec := range m.records {
		if rec.State == InProgress && rec.LeaseUntil.Before(now) {
			out = append(out, rec)
		}
	}
	slices.SortFunc(out, func(a, b *memRecord) int {
		if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
			return c
		}
		return a.CreatedAt.Compare(b.CreatedAt)
	})
	res := make([]Record, 0, min(max(limit, 0), len(out)))
	for i := 0; i < len(out) && i < limit; i++ {
		res = append(res, cloneRecord(out[i]))
	}
	return res, nil
}

// DeleteBefore implements Store.DeleteBefore, oldest UpdatedAt first. A
// limit <= 0 deletes nothing.
func (m *MemoryStore) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var victims []*memRecord
	for _, rec := range m.records {
		if !rec.UpdatedAt.Before(horizon) {
			continue
		}
		if rec.State == Completed || (rec.State == InProgress && rec.LeaseUntil.Before(horizon)) {
			victims = append(victims, rec)
		}
	}
	slices.SortFunc(victims, func(a, b *memRecord) int { return a.UpdatedAt.Compare(b.UpdatedAt) })
	n := 0
	for _, rec := range victims {
		if n >= limit {
			break
		}
		delete(m.records, rec.Scope)
		n++
	}
	return n, nil
}

// Begin implements Transactor.Begin. The returned context is ctx: the memory
// store has no transaction handle of its own to carry.
func (m *MemoryStore) Begin(ctx context.Context, l Lease) (Unit, context.Context, error) {
	if err := ctx.Err(); err != nil {
		return nil, ctx, err
	}
	return &memoryUnit{m: m, lease: l}, ctx, nil
}

type memoryUnit struct {
	m      *MemoryStore
	lease  Lease
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
		return ErrUnitDone
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

func (u *memoryUnit) Complete(_ context.Context, resp Response, now time.Time) error {
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
		return ErrUnitDone
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
			rec.State, rec.resp, rec.CompletedAt, rec.UpdatedAt = Completed, op.resp, op.now, op.now
		} else {
			rec.RecoveryPoint, rec.RecoveryData, rec.UpdatedAt = op.point, op.data, op.now
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

// Len returns the number of records held (for tests and metrics).
func (m *MemoryStore) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.records)
}
