package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// TestRetryAfterTheRecordChanged loses the reply of each kind of write
// after Redis ran it (a proxy closes the connection instead of forwarding
// it), and holds go-redis's retry of the call (its fresh connection
// carries nothing) while another client changes the record: a takeover, a
// restart past the replay window, a new record after a release. The retry
// still returns what the call did: the claim created the record, the
// completion, release, recovery point, heartbeat and end of lease
// succeeded. A takeover whose record changed since cannot tell what it
// found then (its recovery point may have moved on): its retry fails with
// an *OpError, an outcome the caller must take as unknown.
func TestRetryAfterTheRecordChanged(t *testing.T) {
	type store = *redisstore.Store
	type result = idempotency.ClaimResult
	bg, now := context.Background(), time.Now()
	later := func(d time.Duration) time.Time { return now.Add(d) }
	lease := testClaim("k", "x", now).LeaseFor
	none := func(*testing.T, store) idempotency.Lease { return idempotency.Lease{} }
	created := func(t *testing.T, d store) idempotency.Lease { // a's record, in progress
		return mustOutcome(t, d, testClaim("k", "a", now), idempotency.ClaimCreated).Record.Lease()
	}
	takenBy := func(owner string, at time.Time) func(*testing.T, store, idempotency.Lease) {
		return func(t *testing.T, d store, _ idempotency.Lease) {
			mustOutcome(t, d, testClaim("k", owner, at), idempotency.ClaimTakenOver)
		}
	}
	write := func(f func(s store, l idempotency.Lease) error) func(store, idempotency.Lease) (result, error) {
		return func(s store, l idempotency.Lease) (result, error) { return result{}, f(s, l) }
	}
	cases := []struct {
		name string
		// setup prepares the record through direct; call is the write
		// whose reply is lost, on s; change runs before its retry.
		setup  func(t *testing.T, direct store) idempotency.Lease
		call   func(s store, l idempotency.Lease) (result, error)
		change func(t *testing.T, direct store, l idempotency.Lease)
		check  func(t *testing.T, res result, err error)
	}{
		{
			name:  "claim, then taken over",
			setup: none,
			call: func(s store, _ idempotency.Lease) (result, error) {
				return s.Claim(bg, testClaim("k", "a", now))
			},
			change: takenBy("b", later(lease+time.Second)),
			check: func(t *testing.T, res result, err error) {
				require.NoError(t, err)
				require.Equal(t, idempotency.ClaimCreated, res.Outcome, "the claim created the record")
				require.EqualValues(t, 1, res.Record.Generation)
				require.Equal(t, "a", res.Record.Owner)
			},
		},
		{
			name: "takeover, then taken over again",
			setup: func(t *testing.T, d store) idempotency.Lease {
				created(t, d)
				return idempotency.Lease{}
			},
			call: func(s store, _ idempotency.Lease) (result, error) {
				return s.Claim(bg, testClaim("k", "b", later(lease+time.Second)))
			},
			change: takenBy("c", later(3*lease)),
			check: func(t *testing.T, res result, err error) {
				var oe *redisstore.OpError
				require.ErrorAs(t, err, &oe, "got %v %+v", res.Outcome, res.Record)
				require.Equal(t, "claim", oe.Op)
			},
		},
		{
			name:  "completion, then restarted past the window",
			setup: created,
			call: write(func(s store, l idempotency.Lease) error {
				return s.Complete(bg, l, okResponse, now)
			}),
			change: func(t *testing.T, d store, _ idempotency.Lease) {
				res := mustOutcome(t, d, testClaim("k", "b", later(25*time.Hour)), idempotency.ClaimCreated)
				require.EqualValues(t, 2, res.Record.Generation)
			},
			check: noError,
		},
		{
			name:  "release, then claimed anew",
			setup: created,
			call:  write(func(s store, l idempotency.Lease) error { return s.Release(bg, l) }),
			change: func(t *testing.T, d store, _ idempotency.Lease) {
				mustOutcome(t, d, testClaim("k", "b", now), idempotency.ClaimCreated)
			},
			check: noError,
		},
		{
			name:  "recovery point, then taken over",
			setup: created,
			call: write(func(s store, l idempotency.Lease) error {
				return s.SetRecoveryPoint(bg, l, "charged", []byte("c1"), now)
			}),
			change: func(t *testing.T, d store, _ idempotency.Lease) {
				c := testClaim("k", "b", later(lease+time.Second))
				res := mustOutcome(t, d, c, idempotency.ClaimTakenOver)
				require.Equal(t, "charged", res.Record.RecoveryPoint, "the first run set the point")
			},
			check: noError,
		},
		{
			name:  "heartbeat, then taken over",
			setup: created,
			call: write(func(s store, l idempotency.Lease) error {
				return s.Heartbeat(bg, l, later(2*lease))
			}),
			change: func(t *testing.T, d store, l idempotency.Lease) {
				c := testClaim("k", "b", later(lease+time.Second))
				mustOutcome(t, d, c, idempotency.ClaimExisting) // the heartbeat held
				takenBy("b", later(3*lease))(t, d, l)
			},
			check: noError,
		},
		{
			name:   "end of lease, then taken over",
			setup:  created,
			call:   write(func(s store, l idempotency.Lease) error { return s.Heartbeat(bg, l, now) }),
			change: takenBy("b", later(time.Millisecond)),
			check:  noError,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newFaultProxy(t, redisAddr(t))
			// One connection: the retry needs a fresh one, which the
			// proxy holds.
			rdb := redis.NewClient(&redis.Options{Addr: p.addr(), ContextTimeoutEnabled: true,
				PoolSize: 1})
			t.Cleanup(func() { _ = rdb.Close() })
			prefix := freshPrefix(t, rdb)
			// No check of the Store's own through the proxy: its faults are the calls'.
			s := openStore(t, rdb, redisstore.WithPrefix(prefix), redisstore.WithCheckInterval(time.Hour))
			d := openStore(t, clientOf(t, redisAddr(t)), redisstore.WithPrefix(prefix))

			warm(t, s)
			l := tc.setup(t, d)
			p.dropReplies(1)
			p.hold()
			type answer struct {
				res result
				err error
			}
			done := make(chan answer, 1)
			go func() {
				res, err := tc.call(s, l)
				done <- answer{res, err}
			}()
			p.dropped1(t)
			tc.change(t, d, l)
			p.release()
			r := <-done
			tc.check(t, r.res, r.err)
		})
	}
}

// warm runs every write once, so that Redis has every script: a reply
// dropped is then the script's, never a NOSCRIPT refusal.
func warm(t *testing.T, s *redisstore.Store) {
	t.Helper()
	ctx, now := t.Context(), time.Now()
	for _, k := range []string{"warm-1", "warm-2"} {
		res := mustOutcome(t, s, testClaim(k, "w", now), idempotency.ClaimCreated)
		l := res.Record.Lease()
		require.NoError(t, s.Heartbeat(ctx, l, now.Add(time.Minute)))
		require.NoError(t, s.SetRecoveryPoint(ctx, l, "p", nil, now))
		if k == "warm-1" {
			require.NoError(t, s.Complete(ctx, l, okResponse, now))
		} else {
			require.NoError(t, s.Release(ctx, l))
		}
	}
}

func noError(t *testing.T, _ idempotency.ClaimResult, err error) {
	t.Helper()
	require.NoError(t, err, "the write succeeded the first time")
}

func mustOutcome(t *testing.T, s *redisstore.Store, c idempotency.Claim,
	want idempotency.ClaimOutcome) idempotency.ClaimResult {
	t.Helper()
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.Equal(t, want, res.Outcome, "claim by %s", c.Owner)
	return res
}
