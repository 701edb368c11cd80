package linearizability

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// Deliberately broken stores: the check must reject their histories, which
// proves that it can fail.

// checkThenInsert claims in two steps: it reads the record and, when there
// is none, inserts one, overwriting whatever another claim inserted between
// the read and the insert (a SELECT, then an upsert; or a Redis GET, then a
// SET without NX). Both claimants then believe they won.
type checkThenInsert struct{ *memstore.Store }

func (s checkThenInsert) Claim(ctx context.Context, c idempotency.Claim) (
	idempotency.ClaimResult, error) {
	_, err := s.Get(ctx, c.Scope)
	if c.TakeoverOnly || !errors.Is(err, idempotency.ErrNotFound) {
		return s.Store.Claim(ctx, c)
	}
	runtime.Gosched() // between the check and the insert
	for {
		res, err := s.Store.Claim(ctx, c)
		if err != nil || res.Acquired() || res.Record.State != idempotency.InProgress {
			return res, err
		}
		// Another claim inserted since the check: the upsert overwrites it.
		err = s.Release(ctx, res.Record.Lease())
		if err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
			return idempotency.ClaimResult{}, err
		}
	}
}

// unfenced checks the owner of a write but not its generation: an owner
// whose lease was taken over and that took the record back later (under
// the same owner token) still writes with its old lease.
type unfenced struct{ *memstore.Store }

// current returns l with the generation the record holds, when l's owner
// holds it.
func (s unfenced) current(ctx context.Context, l idempotency.Lease) idempotency.Lease {
	if rec, err := s.Get(ctx, l.Scope); err == nil && rec.Owner == l.Owner {
		l.Generation = rec.Generation
	}
	return l
}

func (s unfenced) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	return s.Store.Heartbeat(ctx, s.current(ctx, l), until)
}

func (s unfenced) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	return s.Store.Complete(ctx, s.current(ctx, l), resp, now)
}

func (s unfenced) Release(ctx context.Context, l idempotency.Lease) error {
	return s.Store.Release(ctx, s.current(ctx, l))
}

func (s unfenced) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string,
	data []byte, now time.Time) error {
	return s.Store.SetRecoveryPoint(ctx, s.current(ctx, l), point, data, now)
}

// TestBrokenStoresAreCaught runs the contention workload on each broken
// store and requires porcupine to find its history not linearizable, and
// the visualization of it to be written.
func TestBrokenStoresAreCaught(t *testing.T) {
	for _, c := range []struct {
		name  string
		store func() idempotency.Store
	}{
		{"check_then_insert", func() idempotency.Store { return checkThenInsert{memstore.New()} }},
		{"unfenced_generation", func() idempotency.Store { return unfenced{memstore.New()} }},
	} {
		t.Run(c.name, func(t *testing.T) {
			clk, h, st := newClock(), &history{}, &runStats{}
			contention.run(env{c: caller{c.store(), "broken"}, clk: clk, rec: h, st: st,
				deadline: time.Now().Add(phaseLimit)})
			m := model{evicts: true, epoch: clk.epoch}
			ops := h.operations()
			v := check(m, ops)
			if v.result != porcupine.Illegal {
				t.Fatalf("porcupine says %s of the broken store's history, want %s (%v)",
					v.result, porcupine.Illegal, st)
			}
			t.Logf("caught: %v\n%s", st, m.explain(v.bad))
			path := filepath.Join(t.TempDir(), "vis.html")
			if err := visualize(m, ops, path); err != nil {
				t.Fatal(err)
			}
			if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
				t.Fatalf("no visualization written: %v", err)
			}
		})
	}
}
