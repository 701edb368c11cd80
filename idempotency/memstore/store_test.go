package memstore_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

func TestConformance(t *testing.T) {
	idempotencytest.TestStore(t, func(*testing.T) idempotency.Store { return memstore.New() })
}

func TestBoundedConformance(t *testing.T) {
	idempotencytest.TestBoundedStore(t, func(_ *testing.T, n int) idempotency.Store {
		return memstore.New(memstore.WithMaxRecords(n))
	})
}

func TestUnitOnCommit(t *testing.T) {
	s := memstore.New()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	sc := idempotency.Scope{Principal: "p", Method: "POST", Route: "/r", Key: "k"}
	rec, ok, err := claimed(s.Claim(t.Context(), idempotency.Claim{Scope: sc, Fingerprint: "f", Owner: "a", Now: now, LeaseFor: time.Second}))
	require.NoError(t, err)
	require.True(t, ok)

	var applied int
	u, _, err := s.Begin(t.Context(), rec.Lease())
	require.NoError(t, err)
	require.NoError(t, memstore.OnCommit(u, func() { applied++ }))
	require.NoError(t, u.Rollback())
	require.ErrorContains(t, u.Commit(), "already committed or rolled back")
	require.Zero(t, applied, "a rolled-back unit ran its hook")
	require.ErrorContains(t, memstore.OnCommit(u, func() { applied++ }), "already committed or rolled back")
	// Another store's unit, or none, has no hooks.
	require.ErrorIs(t, memstore.OnCommit(otherUnit{}, func() {}), errors.ErrUnsupported)
	require.ErrorIs(t, memstore.OnCommit(nil, func() {}), errors.ErrUnsupported)

	u, _, err = s.Begin(t.Context(), rec.Lease())
	require.NoError(t, err)
	require.NoError(t, memstore.OnCommit(u, func() { applied++ }))
	require.NoError(t, u.Complete(t.Context(), idempotency.Response{Status: 201}, now))
	require.NoError(t, u.Commit())
	require.Equal(t, 1, applied)
	require.ErrorContains(t, u.Complete(t.Context(), idempotency.Response{}, now), "already committed or rolled back")

	// A hook of a unit whose lease moved never runs.
	sc2 := sc
	sc2.Key = "k2"
	rec2, _, err := claimed(s.Claim(t.Context(), idempotency.Claim{Scope: sc2, Fingerprint: "f", Owner: "a", Now: now, LeaseFor: time.Second}))
	require.NoError(t, err)
	u, _, err = s.Begin(t.Context(), rec2.Lease())
	require.NoError(t, err)
	require.NoError(t, memstore.OnCommit(u, func() { applied++ }))
	_, took, err := claimed(s.Claim(t.Context(), idempotency.Claim{Scope: sc2, Fingerprint: "f", Owner: "b", Now: now.Add(2 * time.Second), LeaseFor: time.Second}))
	require.NoError(t, err)
	require.True(t, took)
	require.ErrorIs(t, u.Commit(), idempotency.ErrLeaseLost)
	require.Equal(t, 1, applied)
}

func TestCanceledContext(t *testing.T) {
	s := memstore.New()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, _, err := claimed(s.Claim(ctx, idempotency.Claim{}))
	require.True(t, errors.Is(err, context.Canceled))
	_, err = s.Get(ctx, idempotency.Scope{})
	require.ErrorIs(t, err, context.Canceled)
}

// A unit applies its writes at Commit in the order they were made, the
// completion included, and a second completion wins over the first.
func TestUnitKeepsTheOrderOfItsWrites(t *testing.T) {
	s := memstore.New()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for i, order := range [][]string{{"point:a", "complete:201", "point:b"}, {"complete:201", "complete:202", "point:c"}} {
		sc := idempotency.Scope{Method: "POST", Route: "/r", Key: "order-" + string(rune('a'+i))}
		rec, ok, err := claimed(s.Claim(t.Context(), idempotency.Claim{Scope: sc, Fingerprint: "f", Owner: "a", Now: now, LeaseFor: time.Minute}))
		require.NoError(t, err)
		require.True(t, ok)
		u, _, err := s.Begin(t.Context(), rec.Lease())
		require.NoError(t, err)
		wantPoint, wantStatus := "", 0
		var at time.Time
		for j, w := range order {
			at = now.Add(time.Duration(j+1) * time.Second) // each write has its own time
			switch w[:5] {
			case "point":
				wantPoint = w[6:]
				require.NoError(t, u.SetRecoveryPoint(t.Context(), wantPoint, nil, at))
			default:
				wantStatus = 200 + int(w[len(w)-1]-'0')
				require.NoError(t, u.Complete(t.Context(), idempotency.Response{Status: wantStatus}, at))
			}
		}
		got, err := s.Get(t.Context(), sc)
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, got.State, "nothing applies before Commit")
		require.NoError(t, u.Commit())
		got, err = s.Get(t.Context(), sc)
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, got.State)
		require.Equal(t, wantPoint, got.RecoveryPoint, "order %v", order)
		require.Equal(t, wantStatus, got.Response.Status, "order %v", order)
		require.Equal(t, at, got.UpdatedAt, "the last write is applied last: order %v", order)
	}
}

// The memory store keeps responses in a flat form of its own: what Get
// returns is exactly what was completed (nil and empty headers, nil and
// repeated values, nil and empty bodies). Its header shares no memory with
// the completed response's or another Get's; its body is the completed
// body itself (bytes given to a Store are not changed by anyone), with no
// capacity past its length, so that an append copies it.
func TestReturnsTheResponseItWasGiven(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for name, resp := range map[string]idempotency.Response{
		"nil header and body":   {Status: 204},
		"empty header and body": {Status: 200, Header: http.Header{}, Body: []byte{}},
		"repeated values": {Status: 201, Header: http.Header{
			"Content-Type": {"application/json"},
			"Link":         {"</a>; rel=a", "</b>; rel=b", "</c>; rel=c"},
			"Vary":         {"Accept", "Accept-Encoding"},
		}},
		"values": {Status: 201, Body: []byte(`{"id":1}`), Header: http.Header{
			"Content-Type":  {"application/json"},
			"Link":          {"</a>; rel=a", "</b>; rel=b"},
			"X-Empty":       {},
			"X-Nil":         nil,
			"non-canonical": {"kept as given"},
		}},
	} {
		t.Run(name, func(t *testing.T) {
			s := memstore.New()
			sc := idempotency.Scope{Method: "POST", Route: "/r", Key: "k"}
			rec, ok, err := claimed(s.Claim(t.Context(), idempotency.Claim{Scope: sc, Fingerprint: "f", Owner: "a", Now: now, LeaseFor: time.Second}))
			require.NoError(t, err)
			require.True(t, ok)
			want := idempotency.Response{Status: resp.Status, Header: resp.Header.Clone(), Body: bytes.Clone(resp.Body)}
			require.NoError(t, s.Complete(t.Context(), rec.Lease(), resp, now))
			for _, v := range resp.Header { // the caller's header is the caller's
				if len(v) > 0 {
					v[0] = "changed by the caller"
				}
			}
			got, err := s.Get(t.Context(), sc)
			require.NoError(t, err)
			require.Equal(t, idempotency.Completed, got.State)
			require.Equal(t, want, *got.Response)
			if len(resp.Body) > 0 {
				require.Same(t, &resp.Body[0], &got.Response.Body[0], "the body is kept, not copied")
				require.Equal(t, len(got.Response.Body), cap(got.Response.Body))
			}
			for _, v := range got.Response.Header { // and a Get's header is the getter's
				if len(v) > 0 {
					v[0] = "changed by a reader"
				}
			}
			again, err := s.Get(t.Context(), sc)
			require.NoError(t, err)
			require.Equal(t, want, *again.Response)
		})
	}
}

// claimed unpacks a Claim's result as (record, acquired, error).
func claimed(res idempotency.ClaimResult, err error) (idempotency.Record, bool, error) {
	return res.Record, res.Acquired(), err
}

// otherUnit is a unit of some other store.
type otherUnit struct{ idempotency.Unit }
