package memstore

import (
	"bytes"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// checkMemory checks what the Store's limits rest on: the count of
// bytes is the sum of the records' sizes, each size is the record measured
// now, the expiry queue is a heap that holds exactly the completed records
// with a window, and a completed record keeps no request.
func checkMemory(t *testing.T, m *Store) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	sum, queued := int64(0), 0
	for sc, rec := range m.records {
		require.Equal(t, sc, rec.Scope)
		require.Equal(t, rec.measure(), rec.size, "record %q", sc.Key)
		sum += rec.size
		if rec.State == idempotency.Completed && rec.window > 0 {
			require.Same(t, rec, m.expiry[rec.idx], "record %q", sc.Key)
			require.True(t, rec.expires.Equal(rec.CompletedAt.Add(rec.window)))
			queued++
		} else {
			require.Equal(t, -1, rec.idx, "record %q", sc.Key)
		}
		if rec.State == idempotency.Completed {
			require.Nil(t, rec.Request, "record %q", sc.Key)
		}
	}
	require.Equal(t, sum, m.bytes)
	require.Len(t, m.expiry, queued)
	for i := 1; i < len(m.expiry); i++ {
		require.False(t, m.expiry[i].expires.Before(m.expiry[(i-1)/2].expires), "heap order at %d", i)
	}
	require.LessOrEqual(t, len(m.records), m.maxRecords)
}

// A long random sequence of every operation, with limits small enough to
// be reached, leaves the count exact at every step (no drift) and at zero
// once every record is gone.
func TestAccountingHasNoDrift(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 99))
			m := New(WithMaxRecords(6), WithMaxBytes(6000))
			ctx := context.Background()
			now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
			leases := map[string]idempotency.Lease{}
			blob := func() []byte { return bytes.Repeat([]byte("b"), rng.IntN(800)) }
			keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
			full := 0
			for range 3000 {
				now = now.Add(time.Duration(rng.IntN(600)) * time.Second)
				key := keys[rng.IntN(len(keys))]
				l, held := leases[key]
				var err error
				switch op := rng.IntN(10); {
				case op < 4:
					c := idempotency.Claim{
						Scope: idempotency.Scope{Principal: "p", Method: "POST", Route: "/r", Key: key}, Fingerprint: "fp" + strconv.Itoa(rng.IntN(2)),
						FingerprintVersion: 1, Owner: "o" + strconv.Itoa(rng.IntN(1000)), Request: blob(), Now: now,
						LeaseFor: time.Minute, ReplayWindow: time.Duration(rng.IntN(3)) * time.Hour, TakeoverOnly: rng.IntN(8) == 0,
					}
					var rec idempotency.Record
					var ok bool
					var res idempotency.ClaimResult
					res, err = m.Claim(ctx, c)
					rec, ok = res.Record, res.Acquired()
					if ok {
						leases[key] = rec.Lease()
					}
					if errors.Is(err, idempotency.ErrStoreFull) {
						full++
						err = nil
					}
				case op == 4 && held:
					err = m.Complete(ctx, l, idempotency.Response{Status: 201, Body: blob()}, now)
				case op == 5 && held:
					err = m.SetRecoveryPoint(ctx, l, "p"+strconv.Itoa(rng.IntN(9)), blob(), now)
				case op == 6 && held:
					u, _, _ := m.Begin(ctx, l)
					for range rng.IntN(4) {
						if rng.IntN(2) == 0 {
							_ = u.Complete(ctx, idempotency.Response{Status: 200, Body: blob(), Header: map[string][]string{"X": {"v"}}}, now)
						} else {
							_ = u.SetRecoveryPoint(ctx, "q", blob(), now)
						}
					}
					err = u.Commit()
				case op == 7 && held:
					err = m.Release(ctx, l)
				case op == 8:
					_, err = m.DeleteBefore(ctx, now.Add(-time.Duration(rng.IntN(4))*time.Hour), rng.IntN(3))
				case op == 9 && held:
					err = m.Heartbeat(ctx, l, now.Add(time.Minute))
				}
				if err != nil && !errors.Is(err, idempotency.ErrLeaseLost) {
					t.Fatal(err)
				}
				checkMemory(t, m)
			}
			require.Positive(t, full, "the limits were never reached")
			_, err := m.DeleteBefore(ctx, now.Add(time.Hour), math.MaxInt)
			require.NoError(t, err)
			checkMemory(t, m)
			require.Zero(t, m.Len())
			require.Zero(t, m.Bytes())
		})
	}
}

// Bad limits keep the defaults: the defaults hold as many records as they
// say, and no more.
func TestDefaultLimits(t *testing.T) {
	s := New(WithMaxRecords(0), WithMaxBytes(-1), nil)
	var err error
	n := 0
	for ; err == nil; n++ {
		_, err = s.Claim(t.Context(), idempotency.Claim{
			Scope: idempotency.Scope{Key: strconv.Itoa(n)}, Fingerprint: "fp", Owner: "o", Now: time.Now(), LeaseFor: time.Minute,
		})
	}
	require.ErrorIs(t, err, idempotency.ErrStoreFull)
	require.Equal(t, defaultMaxRecords, n-1)
	require.Less(t, s.Bytes(), int64(defaultMaxBytes))
}
