package memstore

import (
	"bytes"
	"net/http"
	"strings"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// memRecord is a record as the Store keeps it: its Response is always
// nil, and resp holds the response in a flat form. Its Request is dropped
// when it completes: only a resume (the middleware's takeover, the
// Completer) reads it, and only of a record in progress.
type memRecord struct {
	idempotency.Record
	resp    memResponse
	window  time.Duration // the replay window of the claim that created it; <= 0: never expires
	expires time.Time     // CompletedAt + window, once completed with a window
	idx     int           // its index in the expiry queue, or -1
	size    int64         // its share of Store.bytes
}

// recordOverhead is what a record costs the Store beyond the bytes of
// its strings and byte slices: the record itself, its map entry, its place
// in the expiry queue and the rounding of its allocations, as measured
// with small bodies (TestCountsWhatItHolds checks the count
// against the heap).
const recordOverhead = 600

// measure returns the size of r as the store counts it: recordOverhead plus
// the length of every string and byte slice it holds (16 bytes more per
// header string, for the string itself), and the capacity of the response
// body, which the store keeps as it was given.
func (r *memRecord) measure() int64 {
	n := recordOverhead + len(r.Scope.Principal) + len(r.Scope.Method) + len(r.Scope.Route) +
		len(r.Scope.Key) + len(r.Fingerprint) + len(r.Owner) + len(r.RecoveryPoint) +
		len(r.RecoveryData) + len(r.Request) + cap(r.resp.body)
	for _, v := range r.resp.pairs {
		n += 16 + len(v)
	}
	for k, vs := range r.resp.odd {
		n += 64 + len(k)
		for _, v := range vs {
			n += 16 + len(v)
		}
	}
	return int64(n)
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

// memResponse is a stored response as the Store keeps it, with the
// header as one list of name, value pairs instead of a map: a map of one
// header costs about 400 bytes in three allocations, the list 32 bytes in
// one, and a store keeps a replay window's worth of responses.
type memResponse struct {
	set    bool // the record has a response
	status int
	pairs  []string    // name, value, ...: a name's values in a row; nil for a nil Header
	odd    http.Header // instead of pairs, a copy of a Header that has a name without values
	body   []byte
}

// keep sets the response to resp: its body as it is (a Store keeps the
// bytes it is given, which no one changes: see idempotency.Store), and of
// its header only the strings, never a slice or map of the caller's.
func (r *memResponse) keep(resp *idempotency.Response) {
	*r = memResponse{set: true, status: resp.Status, body: resp.Body}
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

// response returns the response, or nil when there is none: a header of
// its own (as Header.Clone copies), and the stored body itself, whose
// capacity ends at its length, so that an append copies it.
func (r *memResponse) response() *idempotency.Response {
	if !r.set {
		return nil
	}
	body := r.body
	if body != nil {
		body = body[:len(body):len(body)]
	}
	out := &idempotency.Response{Status: r.status, Body: body, Header: r.odd.Clone()}
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

func cloneRecord(r *memRecord) idempotency.Record {
	c := r.Record
	c.RecoveryData = bytes.Clone(r.RecoveryData)
	c.Request = bytes.Clone(r.Request)
	c.Response = r.resp.response()
	return c
}

// existing returns what a ClaimExisting result holds of rec: no request and
// no recovery data to copy.
func existing(rec *memRecord) idempotency.Record {
	return idempotency.Record{
		Scope: rec.Scope, State: rec.State, Fingerprint: rec.Fingerprint,
		FingerprintVersion: rec.FingerprintVersion, Owner: rec.Owner, Generation: rec.Generation,
		LeaseUntil: rec.LeaseUntil, CompletedAt: rec.CompletedAt, Response: rec.resp.response(),
	}
}

// newMemRecord returns the in-progress record that c creates, with
// generation gen, measured. Its strings are copies, in one allocation: a
// string of the caller's may be part of a larger one (net/http's method is
// part of the request line), which the record must not keep alive.
func newMemRecord(c idempotency.Claim, gen int64) *memRecord {
	var b strings.Builder
	parts := [...]string{c.Scope.Principal, c.Scope.Method, c.Scope.Route, c.Scope.Key,
		c.Fingerprint, c.Owner}
	n := 0
	for _, v := range parts {
		n += len(v)
	}
	b.Grow(n)
	for _, v := range parts {
		b.WriteString(v)
	}
	all := b.String()
	next := func(v string) string {
		out := all[:len(v)]
		all = all[len(v):]
		return out
	}
	rec := &memRecord{Record: idempotency.Record{
		Scope: idempotency.Scope{
			Principal: next(c.Scope.Principal), Method: next(c.Scope.Method),
			Route: next(c.Scope.Route), Key: next(c.Scope.Key),
		},
		State:              idempotency.InProgress,
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
