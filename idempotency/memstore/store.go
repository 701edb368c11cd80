// Package memstore is the bounded in-memory idempotency.Store, for tests and
// single-process servers.
package memstore

import (
	"bytes"
	"container/heap"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// The limits' defaults (WithMaxRecords, WithMaxBytes).
const (
	// 100,000 records: about 90 MiB with small bodies.
	defaultMaxRecords = 100_000
	// 256 MiB, as Store.Bytes counts: it binds first when records average
	// more than about 2.6 KiB.
	defaultMaxBytes = 256 << 20
)

// Store is an idempotency.Store, Sweeper and Transactor that keeps
// records in process memory, for tests and single-process servers: they do
// not survive a restart and are not shared between processes. Make one
// with New; every method takes one mutex, so it is safe for concurrent use
// and its claims are atomic. It copies what it is given and what it
// returns, except a response body: it keeps the one Complete is given and
// returns those very bytes from every Claim and Get, which no one may
// modify (see idempotency.Store).
type Store struct {
	mu         sync.Mutex
	records    map[idempotency.Scope]*memRecord
	expiry     expiryQueue // the completed records that expire, soonest first
	bytes      int64       // the sum of the records' size
	maxRecords int
	maxBytes   int64
}

// Option configures New. Options are applied in order; a later one wins.
type Option func(*Store)

// WithMaxRecords sets the number of records the Store holds at most
// (default 100,000: a sustained 1.1 new keys a second over a 24-hour replay
// window). Values <= 0 keep the default; math.MaxInt means no limit.
func WithMaxRecords(n int) Option {
	return func(m *Store) {
		if n > 0 {
			m.maxRecords = n
		}
	}
}

// WithMaxBytes sets the memory the Store's records may take at most, as
// Bytes counts it (default 256 MiB). Values <= 0 keep the default;
// math.MaxInt64 means no limit.
func WithMaxBytes(n int64) Option {
	return func(m *Store) {
		if n > 0 {
			m.maxBytes = n
		}
	}
}

// New returns an empty Store, bounded by WithMaxRecords and WithMaxBytes.
//
// It evicts a completed record once it is past the replay window of the
// claim that created it (a ReplayWindow <= 0: never), a few at each claim
// that creates a record and as many as that claim needs: no goroutine, no
// Reaper needed for completed records. A claim that would create a record
// when the store is at a limit, and can evict nothing, fails with an error
// wrapping idempotency.ErrStoreFull (the middleware answers 503
// CodeStoreFull with Retry-After: 1); a record larger than WithMaxBytes,
// with idempotency.ErrRecordTooLarge (413). It never evicts a record in
// progress nor one within its window, and never refuses a claim of an
// existing record, a completion or a recovery point, so the bytes may go
// over the limit by what the records in progress store.
//
// A record costs about 600 bytes plus its scope, its response and, while in
// progress, its stored request, which it drops at completion. Its Units
// apply their writes at Commit, under the store's lock; OnCommit adds a
// handler's own in-memory writes to them.
func New(opts ...Option) *Store {
	m := &Store{
		records:    make(map[idempotency.Scope]*memRecord),
		maxRecords: defaultMaxRecords,
		maxBytes:   defaultMaxBytes,
	}
	for _, o := range opts {
		if o != nil {
			o(m)
		}
	}
	return m
}

var (
	_ idempotency.Store      = (*Store)(nil)
	_ idempotency.Sweeper    = (*Store)(nil)
	_ idempotency.Transactor = (*Store)(nil)
)

// sweepPerClaim is how many expired records a claim that creates a record
// evicts at most, beyond those it needs to make room: more than the one
// record it adds, so that expired records never pile up.
const sweepPerClaim = 4

// Claim implements idempotency.Store.Claim. It honours ctx only before
// taking the lock; a claim that would create a record fails when the store
// has no room for it (see New).
func (m *Store) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return idempotency.ClaimResult{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[c.Scope]
	if !ok && c.TakeoverOnly {
		return idempotency.ClaimResult{}, nil
	}
	gen := int64(1)
	if ok {
		switch {
		case rec.State == idempotency.Completed && !c.TakeoverOnly && c.ReplayWindow > 0 &&
			c.Now.Sub(rec.CompletedAt) > c.ReplayWindow:
			gen = rec.Generation + 1 // out of the replay window: a new request
			m.remove(rec)
		case rec.State == idempotency.InProgress && rec.LeaseUntil.Before(c.Now) &&
			rec.Fingerprint == c.Fingerprint && rec.FingerprintVersion == c.FingerprintVersion:
			rec.Owner = strings.Clone(c.Owner)
			rec.Generation++
			rec.LeaseUntil = c.Now.Add(c.LeaseFor)
			rec.UpdatedAt = c.Now
			m.resize(rec)
			taken := cloneRecord(rec)
			taken.Response = nil
			return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: taken}, nil
		default:
			return idempotency.ClaimResult{Record: existing(rec)}, nil // ClaimExisting
		}
	}
	rec = newMemRecord(c, gen)
	if err := m.makeRoom(rec.size, c.Now); err != nil {
		return idempotency.ClaimResult{}, err
	}
	m.records[rec.Scope] = rec
	m.bytes += rec.size
	created := rec.Record
	created.Request = nil
	return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: created}, nil
}

// makeRoom evicts up to sweepPerClaim records expired at now, then as many
// more as a new record of size bytes needs, and fails with ErrStoreFull when
// that is not enough (ErrRecordTooLarge when no room could ever be enough).
// m.mu must be held.
func (m *Store) makeRoom(size int64, now time.Time) error {
	if size > m.maxBytes {
		return fmt.Errorf("%w: a new record of %d bytes, at most %d",
			idempotency.ErrRecordTooLarge, size, m.maxBytes)
	}
	for range sweepPerClaim {
		if !m.evictExpired(now) {
			break
		}
	}
	for len(m.records) >= m.maxRecords || size > m.maxBytes-m.bytes {
		if !m.evictExpired(now) {
			return fmt.Errorf("%w: %d records of at most %d, %d bytes of at most %d, "+
				"a new record of %d bytes",
				idempotency.ErrStoreFull, len(m.records), m.maxRecords, m.bytes, m.maxBytes, size)
		}
	}
	return nil
}

// evictExpired removes the completed record that expires soonest if it
// expired before now, and reports whether it did. m.mu must be held.
func (m *Store) evictExpired(now time.Time) bool {
	if len(m.expiry) == 0 || !m.expiry[0].expires.Before(now) {
		return false
	}
	m.remove(m.expiry[0])
	return true
}

// remove deletes rec from the store. m.mu must be held.
func (m *Store) remove(rec *memRecord) {
	delete(m.records, rec.Scope)
	if rec.idx >= 0 {
		heap.Remove(&m.expiry, rec.idx)
	}
	m.bytes -= rec.size
	rec.size = 0
}

// resize measures rec again after a change and updates the store's count
// of bytes. m.mu must be held.
func (m *Store) resize(rec *memRecord) {
	size := rec.measure()
	m.bytes += size - rec.size
	rec.size = size
}

// completeRecord completes rec with resp (the store's own form of it) at now: its request
// is dropped (only a resume reads it), and it joins the expiry queue when
// it has a replay window. m.mu must be held.
func (m *Store) completeRecord(rec *memRecord, resp memResponse, now time.Time) {
	rec.State, rec.resp, rec.CompletedAt, rec.UpdatedAt = idempotency.Completed, resp, now, now
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
func (m *Store) setPoint(rec *memRecord, point string, data []byte, now time.Time) {
	rec.RecoveryPoint, rec.RecoveryData, rec.UpdatedAt = point, data, now
	m.resize(rec)
}

// Get implements idempotency.Store.Get.
func (m *Store) Get(ctx context.Context, s idempotency.Scope) (idempotency.Record, error) {
	if err := ctx.Err(); err != nil {
		return idempotency.Record{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.records[s]
	if !ok {
		return idempotency.Record{}, idempotency.ErrNotFound
	}
	return cloneRecord(rec), nil
}

// owned returns the in-progress record that l owns; m.mu must be held.
func (m *Store) owned(l idempotency.Lease) (*memRecord, error) {
	rec, ok := m.records[l.Scope]
	if !ok || rec.State != idempotency.InProgress || rec.Owner != l.Owner ||
		rec.Generation != l.Generation {
		return nil, idempotency.ErrLeaseLost
	}
	return rec, nil
}

// fenced runs write on the in-progress record that l owns, under the lock:
// the one fence that every conditional write of the store goes through.
func (m *Store) fenced(ctx context.Context, l idempotency.Lease, write func(rec *memRecord)) error {
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

// Heartbeat implements idempotency.Store.Heartbeat.
func (m *Store) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	return m.fenced(ctx, l, func(rec *memRecord) { rec.LeaseUntil = until })
}

// Complete implements idempotency.Store.Complete. It drops the record's stored request
// and never fails for lack of room.
func (m *Store) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	var kept memResponse
	kept.keep(&resp)
	return m.fenced(ctx, l, func(rec *memRecord) { m.completeRecord(rec, kept, now) })
}

// Release implements idempotency.Store.Release.
func (m *Store) Release(ctx context.Context, l idempotency.Lease) error {
	return m.fenced(ctx, l, m.remove)
}

// SetRecoveryPoint implements idempotency.Store.SetRecoveryPoint. It never fails for
// lack of room.
func (m *Store) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string,
	data []byte, now time.Time) error {
	data = bytes.Clone(data)
	return m.fenced(ctx, l, func(rec *memRecord) { m.setPoint(rec, point, data, now) })
}

// Abandoned implements idempotency.Sweeper.Abandoned: in-progress records whose lease
// ended before now (LeaseUntil < now, strictly), ordered by LeaseUntil, then
// CreatedAt. A limit <= 0 returns nothing.
func (m *Store) Abandoned(ctx context.Context, now time.Time, limit int) (
	[]idempotency.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*memRecord
	for _, rec := range m.records {
		if rec.State == idempotency.InProgress && rec.LeaseUntil.Before(now) {
			out = append(out, rec)
		}
	}
	slices.SortFunc(out, func(a, b *memRecord) int {
		if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
			return c
		}
		return a.CreatedAt.Compare(b.CreatedAt)
	})
	res := make([]idempotency.Record, 0, min(max(limit, 0), len(out)))
	for i := 0; i < len(out) && i < limit; i++ {
		res = append(res, cloneRecord(out[i]))
	}
	return res, nil
}

// DeleteBefore implements idempotency.Sweeper.DeleteBefore, oldest UpdatedAt first. A
// limit <= 0 deletes nothing.
func (m *Store) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
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
		if rec.State == idempotency.Completed ||
			(rec.State == idempotency.InProgress && rec.LeaseUntil.Before(horizon)) {
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

// Len returns the number of records held (for tests and metrics). Safe for
// concurrent use.
func (m *Store) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.records)
}

// Bytes returns the memory the records take as the store counts it, which
// WithMaxBytes bounds (for tests and metrics): per record about 600 bytes
// plus the length of its strings and byte slices (scope, fingerprint, owner,
// recovery point and data, stored request while in progress, response
// headers and body). Safe for concurrent use.
func (m *Store) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}
