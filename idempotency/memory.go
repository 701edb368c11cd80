package idempotency

import (
	"bytes"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// ErrUnitDone is returned by a MemoryStore Unit used after Commit or
// Rollback.
var ErrUnitDone = errors.New("idempotency: unit already committed or rolled back")

// Defaults of the MemoryStore's limits (WithMaxRecords, WithMaxBytes).
const (
	// DefaultMemoryMaxRecords is the number of records a MemoryStore holds
	// at most: 100,000, about 90 MiB of records with small bodies (a
	// record costs about 900 bytes with a 64-byte request and response),
	// or a sustained 1.1 new keys per second over the default 24-hour
	// replay window (a server with more new keys raises it, or uses a SQL
	// store).
	DefaultMemoryMaxRecords = 100_000
	// DefaultMemoryMaxBytes is the memory a MemoryStore's records may take
	// at most, as the store counts it (MemoryStore.Bytes): 256 MiB. It
	// binds before DefaultMemoryMaxRecords when records average more than
	// about 2.6 KiB, for example 256 records with 1 MiB responses.
	DefaultMemoryMaxBytes = 256 << 20
)

// MemoryStore is a Store and Transactor that keeps records in process
// memory, for tests and single-process servers: records do not survive a
// restart and are not shared between processes. The zero value is not
// usable; call NewMemoryStore. Safe for concurrent use; every operation
// takes one mutex, so claims are atomic. The store copies what it is given
// and what it returns: records share no memory with the store.
//
// It is bounded (see NewMemoryStore): it holds at most a number of records
// and of bytes, evicts completed records once they are past their replay
// window by itself, and refuses new records with ErrStoreFull when it has no
// room, never dropping a record in progress or one within its window.
type MemoryStore struct {
	mu         sync.Mutex
	records    map[Scope]*memRecord
	expiry     expiryQueue // the completed records that expire, soonest first
	bytes      int         // the sum of the records' size
	maxRecords int
	maxBytes   int
}

// memRecord is a record as the MemoryStore keeps it: its Response is always
// nil, and resp holds the response in a flat form. Its Request is dropped
// when it completes: only a resume (the middleware's takeover, the
// Completer) reads it, and only of a record in progress.
type memRecord struct {
	Record
	resp    memResponse
	window  time.Duration // the replay window of the claim that created it; <= 0: never expires
	expires time.Time     // CompletedAt + window, once completed with a window
	idx     int           // its index in the expiry queue, or -1
	size    int           // its share of MemoryStore.bytes
}

// recordOverhead is what a record costs the MemoryStore beyond the bytes of
// its strings and byte slices: the record itself, its map entry, its place
// in the expiry queue and the rounding of its allocations, as measured
// with small bodies (TestMemoryStoreCountsWhatItHolds checks the count
// against the heap).
const recordOverhead = 600

// measure returns the size of r as the store counts it: recordOverhead plus
// the length of every string and byte slice it holds (16 bytes more per
// header string, for the string itself).
func (r *memRecord) measure() int {
	n := recordOverhead + len(r.Scope.Principal) + len(r.Scope.Method) + len(r.Scope.Route) + len(r.Scope.Key) +
		len(r.Fingerprint) + len(r.Owner) + len(r.RecoveryPoint) + len(r.RecoveryData) + len(r.Request) + len(r.resp.body)
	for _, v := range r.resp.pairs {
		n += 16 + len(v)
	}
	for k, vs := range r.resp.odd {
		n += 64 + len(k)
		for _, v := range vs {
			n += 16 + len(v)
		}
	}
	return n
}

// expiryQueue is a heap (container/heap) of completed records by expiry,
// soonest first; each record knows its index.
type expiryQueue []*memRecord

func (q expiryQueue) Len() int           { return len(q) }
func (q expiryQueue) Less(i, j int) bool { return q[i].expires.Before(q[j].expires) }
func (q expiryQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].idx, q[j].idx = i, j
}
func (q *expiryQueue) Push(x any) {
	r := x.(*memRecord)
	r.idx = len(*q)
	*q = append(*q, r)
}
func (q *expiryQueue) Pop() any {
	old := *q
	r := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	r.idx = -1
	return r
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

// MemoryOption configures NewMemoryStore. Options are applied in order; a
// later one wins.
type MemoryOption func(*MemoryStore)

// WithMaxRecords sets the number of records a MemoryStore holds at most
// (DefaultMemoryMaxRecords). A value <= 0 keeps the default; pass
// math.MaxInt for no limit.
func WithMaxRecords(n int) MemoryOption {
	return func(m *MemoryStore) {
		if n > 0 {
			m.maxRecords = n
		}
	}
}

// WithMaxBytes sets the memory a MemoryStore's records may take at most, as
// it counts them (see MemoryStore.Bytes; DefaultMemoryMaxBytes). A value
// <= 0 keeps the default; pass math.MaxInt for no limit.
func WithMaxBytes(n int) MemoryOption {
	return func(m *MemoryStore) {
		if n > 0 {
			m.maxBytes = n
		}
	}
}

// NewMemoryStore returns an empty MemoryStore, bounded by WithMaxRecords
// and WithMaxBytes (DefaultMemoryMaxRecords, DefaultMemoryMaxBytes).
//
// A record that completed is evicted once it is past the replay window of
// the claim that created it (CompletedAt + Claim.ReplayWindow < now): a
// claim that creates a record first evicts a few such records, soonest
// expiry first, and as many as it needs to make room. There is no
// background goroutine and no need of a Reaper for completed records; a
// record created with a ReplayWindow <= 0 never expires. A claim that would
// create a record when the store is at either limit, and finds no expired
// record to evict, fails with an error wrapping ErrStoreFull, which the
// middleware answers with 503 CodeStoreUnavailable and Retry-After: 1. The
// store never evicts a record in progress (abandoned ones included: the
// Completer or the Reaper settles those) nor a completed one within its
// window, and a claim of an existing key (a replay, a takeover) never fails
// for lack of room. The limits bound what new claims may take: a
// completion or a recovery point of a record in progress is always
// accepted, so the bytes may go over the limit by what the records in
// progress at that time store.
//
// A record costs about 600 bytes plus its scope, its response and, while it
// is in progress, its stored request (1.33 times the request body: its body
// is base64-encoded); the request is dropped when it completes, so Get and
// Claim return a completed record with an empty Request (the SQL stores
// keep it).
//
// Its Units (Begin) buffer SetRecoveryPoint and Complete and apply them
// atomically under the store's lock at Commit, which fails with ErrLeaseLost
// (applying nothing) if the lease's owner or generation no longer match an
// in-progress record. A Unit also has a method OnCommit(f func()) (reach it
// with a type assertion to interface{ OnCommit(func()) }) that registers f to
// run under the store's lock at a successful Commit: a handler can apply its
// own in-memory writes there, so that they commit together with the record.
func NewMemoryStore(opts ...MemoryOption) *MemoryStore {
	m := &MemoryStore{
		records:    make(map[Scope]*memRecord),
		maxRecords: DefaultMemoryMaxRecords,
		maxBytes:   DefaultMemoryMaxBytes,
	}
	for _, o := range opts {
		if o != nil {
			o(m)
		}
	}
	return m
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

// sweepPerClaim is how many expired records a claim that creates a record
// evicts at most, beyond those it needs to make room: more than the one
// record it adds, so that expired records never pile up.
const sweepPerClaim = 4

// Claim implements Store.Claim. It honours ctx only before taking the lock.
// A claim that would create a record fails with an error wrapping
// ErrStoreFull when the store has no room for it (see NewMemoryStore).
func (m *MemoryStore) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[c.Scope]
	if !ok && c.TakeoverOnly {
		return ClaimResult{}, nil
	}
	gen := int64(1)
	if ok {
		switch {
		case rec.State == Completed && !c.TakeoverOnly && c.ReplayWindow > 0 && c.Now.Sub(rec.CompletedAt) > c.ReplayWindow:
			gen = rec.Generation + 1 // out of the replay window: a new request
			m.remove(rec)
		case rec.State == InProgress && rec.LeaseUntil.Before(c.Now) && rec.Fingerprint == c.Fingerprint &&
			rec.FingerprintVersion == c.FingerprintVersion:
			rec.Owner = strings.Clone(c.Owner)
			rec.Generation++
			rec.LeaseUntil = c.Now.Add(c.LeaseFor)
			rec.UpdatedAt = c.Now
			m.resize(rec)
			taken := cloneRecord(rec)
			taken.Response = nil
			return ClaimResult{Outcome: ClaimTakenOver, Record: taken}, nil
		default:
			return ClaimResult{Outcome: ClaimExisting, Record: existing(rec)}, nil
		}
	}
	rec = newMemRecord(c, gen)
	if err := m.makeRoom(rec.size, c.Now); err != nil {
		return ClaimResult{}, err
	}
	m.records[rec.Scope] = rec
	m.bytes += rec.size
	created := rec.Record
	created.Request = nil
	return ClaimResult{Outcome: ClaimCreated, Record: created}, nil
}

// existing returns what a ClaimExisting result holds of rec: no request and
// no recovery data to copy.
func existing(rec *memRecord) Record {
	return Record{
		Scope: rec.Scope, State: rec.State, Fingerprint: rec.Fingerprint,
		FingerprintVersion: rec.FingerprintVersion, Owner: rec.Owner, Generation: rec.Generation,
		LeaseUntil: rec.LeaseUntil, CompletedAt: rec.CompletedAt, Response: rec.resp.response(),
	}
}

// newMemRecord returns the in-progress record that c creates, with
// generation gen, measured. Its strings are copies, in one allocation: a
// string of the caller's may be part of a larger one (net/http's method is
// part of the request line), which the record must not keep alive.
func newMemRecord(c Claim, gen int64) *memRecord {
	var b strings.Builder
	b.Grow(len(c.Scope.Principal) + len(c.Scope.Method) + len(c.Scope.Route) + len(c.Scope.Key) + len(c.Fingerprint) + len(c.Owner))
	for _, v := range [...]string{c.Scope.Principal, c.Scope.Method, c.Scope.Route, c.Scope.Key, c.Fingerprint, c.Owner} {
		b.WriteString(v)
	}
	all := b.String()
	next := func(v string) string {
		out := all[:len(v)]
		all = all[len(v):]
		return out
	}
	rec := &memRecord{Record: Record{
		Scope: Scope{
			Principal: next(c.Scope.Principal), Method: next(c.Scope.Method),
			Route: next(c.Scope.Route), Key: next(c.Scope.Key),
		},
		State:              InProgress,
		Fingerprint:        next(c.Fingerprint),
		FingerprintVersion: c.FingerprintVersion,
		Owner:              next(c.Owner),
		Generation:         gen,
		LeaseUntil:         c.Now.Add(c.LeaseFor),
		Request:            bytes.Clone(c.Request),
		CreatedAt:          c.Now,
		UpdatedAt:          c.Now,
	}, window: c.ReplayWindow, idx: -1}
	rec.size = rec.measure()
	return rec
}

// makeRoom evicts up to sweepPerClaim records expired at now, then as many
// more as a new record of size bytes needs, and fails with ErrStoreFull when
// that is not enough (ErrRecordTooLarge when no room could ever be enough).
// m.mu must be held.
func (m *MemoryStore) makeRoom(size int, now time.Time) error {
	if size > m.maxBytes {
		return fmt.Errorf("%w: a new record of %d bytes, at most %d", ErrRecordTooLarge, size, m.maxBytes)
	}
	for range sweepPerClaim {
		if !m.evictExpired(now) {
			break
		}
	}
	for len(m.records) >= m.maxRecords || size > m.maxBytes-m.bytes {
		if !m.evictExpired(now) {
			return fmt.Errorf("%w: %d records of at most %d, %d bytes of at most %d, a new record of %d bytes",
				ErrStoreFull, len(m.records), m.maxRecords, m.bytes, m.maxBytes, size)
		}
	}
	return nil
}

// evictExpired removes the completed record that expires soonest if it
// expired before now, and reports whether it did. m.mu must be held.
func (m *MemoryStore) evictExpired(now time.Time) bool {
	if len(m.expiry) == 0 || !m.expiry[0].expires.Before(now) {
		return false
	}
	m.remove(m.expiry[0])
	return true
}

// remove deletes rec from the store. m.mu must be held.
func (m *MemoryStore) remove(rec *memRecord) {
	delete(m.records, rec.Scope)
	if rec.idx >= 0 {
		heap.Remove(&m.expiry, rec.idx)
	}
	m.bytes -= rec.size
	rec.size = 0
}

// resize measures rec again after a change and updates the store's count
// of bytes. m.mu must be held.
func (m *MemoryStore) resize(rec *memRecord) {
	size := rec.measure()
	m.bytes += size - rec.size
	rec.size = size
}

// settle completes rec with resp (the store's own copy) at now: its request
// is dropped (only a resume reads it), and it joins the expiry queue when
// it has a replay window. m.mu must be held.
func (m *MemoryStore) settle(rec *memRecord, resp memResponse, now time.Time) {
	rec.State, rec.resp, rec.CompletedAt, rec.UpdatedAt = Completed, resp, now, now
	rec.Request = nil
	if rec.window > 0 {
		rec.expires = now.Add(rec.window)
		if rec.idx >= 0 {
			heap.Fix(&m.expiry, rec.idx) // completed twice in one unit
		} else {
			heap.Push(&m.expiry, rec)
		}
	}
	m.resize(rec)
}

// setPoint records a recovery point on rec. m.mu must be held.
func (m *MemoryStore) setPoint(rec *memRecord, point string, data []byte, now time.Time) {
	rec.RecoveryPoint, rec.RecoveryData, rec.UpdatedAt = point, data, now
	m.resize(rec)
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

// EndLease implements Store.EndLease.
func (m *MemoryStore) EndLease(ctx context.Context, l Lease, now time.Time) error {
	return m.fenced(ctx, l, func(rec *memRecord) { rec.LeaseUntil = now })
}

// Complete implements Store.Complete. It drops the record's stored request
// and never fails for lack of room.
func (m *MemoryStore) Complete(ctx context.Context, l Lease, resp Response, now time.Time) error {
	var kept memResponse
	kept.keep(&resp)
	return m.fenced(ctx, l, func(rec *memRecord) { m.settle(rec, kept, now) })
}

// Release implements Store.Release.
func (m *MemoryStore) Release(ctx context.Context, l Lease) error {
	return m.fenced(ctx, l, m.remove)
}

// SetRecoveryPoint implements Store.SetRecoveryPoint. It never fails for
// lack of room.
func (m *MemoryStore) SetRecoveryPoint(ctx context.Context, l Lease, point string, data []byte, now time.Time) error {
	data = bytes.Clone(data)
	return m.fenced(ctx, l, func(rec *memRecord) { m.setPoint(rec, point, data, now) })
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
		m.remove(rec)
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

// Len returns the number of records held (for tests and metrics). Safe for
// concurrent use.
func (m *MemoryStore) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.records)
}

// Bytes returns the memory the records take as the store counts it, which
// WithMaxBytes bounds (for tests and metrics): per record about 600 bytes
// plus the length of its strings and byte slices (scope, fingerprint, owner,
// recovery point and data, stored request while in progress, response
// headers and body). Safe for concurrent use.
func (m *MemoryStore) Bytes() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}
