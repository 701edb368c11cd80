package redisstore_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

func testScope(key string) idempotency.Scope {
	return idempotency.Scope{Principal: "acct-1", Method: http.MethodPost, Route: "POST /payments", Key: key}
}

func testClaim(key, owner string, now time.Time) idempotency.Claim {
	return idempotency.Claim{
		Scope: testScope(key), Fingerprint: "fp", FingerprintVersion: 1, Owner: owner,
		Request: []byte("request of " + key), Now: now, LeaseFor: 30 * time.Second, ReplayWindow: 24 * time.Hour,
	}
}

var okResponse = idempotency.Response{Status: http.StatusCreated,
	Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}

// keysLike returns the store's keys under prefix that match pattern
// (after the prefix), on every primary.
func keysLike(t *testing.T, rdb redis.UniversalClient, prefix, pattern string) []string {
	t.Helper()
	var out []string
	scan := func(ctx context.Context, c *redis.Client) error {
		ks, err := c.Keys(ctx, prefix+pattern).Result()
		out = append(out, ks...)
		return err
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		var mu = make(chan struct{}, 1)
		require.NoError(t, c.ForEachMaster(t.Context(), func(ctx context.Context, n *redis.Client) error {
			mu <- struct{}{}
			defer func() { <-mu }()
			return scan(ctx, n)
		}))
	case *redis.Client:
		require.NoError(t, scan(t.Context(), c))
	}
	return out
}

// TestRetriedAfterLostReply loses, with its connection, the reply of every
// kind of write after Redis ran it (a proxy closes the connection instead
// of forwarding the answer). go-redis runs the script again on a fresh
// connection, and each call still returns what it did: the claim is the
// claimant's (created, or taken over), the completion and the release
// succeeded.
func TestRetriedAfterLostReply(t *testing.T) {
	p := newFaultProxy(t, redisAddr(t))
	rdb := redis.NewClient(&redis.Options{Addr: p.addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := freshPrefix(t, rdb)
	// No check of the Store's own through the proxy: its faults are the calls'.
	s := openStore(t, rdb, redisstore.WithPrefix(prefix), redisstore.WithCheckInterval(time.Hour))
	ctx := t.Context()
	now := time.Now()
	lost := func(what string, f func()) {
		t.Helper()
		before := p.dropped.Load()
		p.dropReplies(1)
		f()
		require.Equal(t, before+1, p.dropped.Load(), "%s: the fault did not hit", what)
	}

	var res idempotency.ClaimResult
	var err error
	lost("claim", func() {
		res, err = s.Claim(ctx, testClaim("k", "a", now))
		require.NoError(t, err)
	})
	require.Equal(t, idempotency.ClaimCreated, res.Outcome, "a retried claim is the claimant's")
	require.EqualValues(t, 1, res.Record.Generation)
	l := res.Record.Lease()
	lost("set_recovery_point", func() {
		require.NoError(t, s.SetRecoveryPoint(ctx, l, "order", []byte("o1"), now))
	})
	lost("heartbeat", func() { require.NoError(t, s.Heartbeat(ctx, l, now.Add(time.Minute))) })
	lost("heartbeat to now", func() { require.NoError(t, s.Heartbeat(ctx, l, now)) })

	lost("takeover", func() {
		res, err = s.Claim(ctx, testClaim("k", "b", now.Add(time.Second)))
		require.NoError(t, err)
	})
	require.Equal(t, idempotency.ClaimTakenOver, res.Outcome, "a retried takeover is the claimant's")
	require.EqualValues(t, 2, res.Record.Generation)
	require.Equal(t, "order", res.Record.RecoveryPoint)
	require.Equal(t, []byte("o1"), res.Record.RecoveryData)
	l = res.Record.Lease()

	lost("complete", func() { require.NoError(t, s.Complete(ctx, l, okResponse, now.Add(2*time.Second))) })
	got, err := s.Get(ctx, l.Scope)
	require.NoError(t, err)
	require.Equal(t, idempotency.Completed, got.State)
	require.Equal(t, okResponse.Body, got.Response.Body)
	require.ErrorIs(t, s.Complete(ctx, l, okResponse, now.Add(3*time.Second)), idempotency.ErrLeaseLost,
		"a second completion (not a retry) is refused")

	res, err = s.Claim(ctx, testClaim("r", "c", now))
	require.NoError(t, err)
	lost("release", func() { require.NoError(t, s.Release(ctx, res.Record.Lease())) })
	_, err = s.Get(ctx, testScope("r"))
	require.ErrorIs(t, err, idempotency.ErrNotFound, "the release happened")
}

// TestCallsHaveDeadlines holds every reply of Redis back (a proxy adds 3 s
// of latency): a call ends at the Store's WithTimeout with an *OpError, and
// the claim it made stays the claimant's, so another claim of the key is
// refused (no second execution).
func TestCallsHaveDeadlines(t *testing.T) {
	p := newFaultProxy(t, redisAddr(t))
	rdb := redis.NewClient(&redis.Options{Addr: p.addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := freshPrefix(t, rdb)
	// No check of the Store's own through the proxy: its faults are the calls'.
	s := openStore(t, rdb, redisstore.WithPrefix(prefix), redisstore.WithTimeout(200*time.Millisecond),
		redisstore.WithCheckInterval(time.Hour))
	p.setLatency(3 * time.Second)
	start := time.Now()
	_, err := s.Claim(context.Background(), testClaim("slow", "a", time.Now()))
	var oe *redisstore.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "claim", oe.Op)
	require.Less(t, time.Since(start), 2*time.Second, "the call outlived its deadline")
	p.setLatency(0)

	direct := clientOf(t, redisAddr(t))
	s2 := openStore(t, direct, redisstore.WithPrefix(prefix))
	rec, err := s2.Get(t.Context(), testScope("slow"))
	require.NoError(t, err, "the claim reached Redis")
	require.Equal(t, "a", rec.Owner)
	res, err := s2.Claim(t.Context(), testClaim("slow", "b", time.Now()))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimExisting, res.Outcome)
}

// TestRedisExpiresRecords checks the time to live Redis holds for a record,
// from the claim's own policy and no other: in progress, its lease plus its
// replay window and the larger of its lease and a minute, plus the 30-day
// backstop (a heartbeat counts the lease from it); once completed, the
// window plus that margin; with no window, the backstop.
func TestRedisExpiresRecords(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, rdb, prefix := newStore(t, b)
		ttl := func(key string) time.Duration {
			t.Helper()
			ks := keysLike(t, rdb, prefix, "*}r:*")
			for _, k := range ks {
				if rdb.HGet(t.Context(), k, "k").Val() == key {
					d, err := rdb.PTTL(t.Context(), k).Result()
					require.NoError(t, err)
					return d
				}
			}
			t.Fatalf("no record of %s", key)
			return 0
		}
		near := func(what string, got, want time.Duration) {
			t.Helper()
			require.InDelta(t, want.Seconds(), got.Seconds(), 1, what)
		}
		const month = 30 * 24 * time.Hour
		now := time.Now()
		c := testClaim("exp", "a", now) // lease 30 s, window 24 h
		res, err := s.Claim(t.Context(), c)
		require.NoError(t, err)
		near("in progress", ttl("exp"), 30*time.Second+24*time.Hour+time.Minute+month)
		require.NoError(t, s.Heartbeat(t.Context(), res.Record.Lease(), now.Add(time.Hour)))
		near("after a heartbeat", ttl("exp"), time.Hour+24*time.Hour+time.Minute+month)
		require.NoError(t, s.Complete(t.Context(), res.Record.Lease(), okResponse, now))
		near("completed: window and a minute", ttl("exp"), 24*time.Hour+time.Minute)

		c = testClaim("long-lease", "a", now.Add(-400*24*time.Hour)) // its times far in the past
		c.LeaseFor, c.ReplayWindow = 10*time.Minute, time.Hour
		res, err = s.Claim(t.Context(), c)
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), res.Record.Lease(), okResponse, c.Now))
		near("completed: window and the lease, over a minute", ttl("long-lease"),
			time.Hour+10*time.Minute)

		c = testClaim("no-window", "a", now)
		c.ReplayWindow = 0
		res, err = s.Claim(t.Context(), c)
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), res.Record.Lease(), okResponse, now))
		near("completed, no window: the backstop", ttl("no-window"), month)
	})
}

// TestExpiredRecordsLeaveTheIndexes has Redis expire records (the test
// shortens their time to live to a millisecond, as the passing of their
// window would) and checks that the listings skip them and take their
// members out of the indexes, and that a completion trims, in its shard,
// the done members completed before its own replay window and margin.
func TestExpiredRecordsLeaveTheIndexes(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, rdb, prefix := newStore(t, b)
		ctx := t.Context()
		old := time.Now().Add(-10 * time.Hour)
		within := func(k, owner string, now time.Time) idempotency.Claim {
			c := testClaim(k, owner, now)
			c.ReplayWindow = time.Minute
			return c
		}
		for _, k := range []string{"a", "b", "c"} {
			_, err := s.Claim(ctx, testClaim(k, "o", old))
			require.NoError(t, err)
		}
		for _, k := range []string{"d", "e"} {
			res, err := s.Claim(ctx, within(k, "o", old))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, res.Record.Lease(), okResponse, old))
		}
		for _, k := range keysLike(t, rdb, prefix, "*}r:*") {
			require.NoError(t, rdb.PExpire(ctx, k, time.Millisecond).Err())
		}
		require.Eventually(t, func() bool { return len(keysLike(t, rdb, prefix, "*}r:*")) == 0 },
			10*time.Second, time.Millisecond, "Redis expired every record")
		members := func(index string) int64 {
			var n int64
			for _, k := range keysLike(t, rdb, prefix, "*}"+index) {
				n += rdb.ZCard(ctx, k).Val()
			}
			return n
		}
		require.EqualValues(t, 3, members("lease"))
		require.EqualValues(t, 2, members("done"))
		recs, err := s.Abandoned(ctx, time.Now(), 10)
		require.NoError(t, err)
		require.Empty(t, recs)
		require.EqualValues(t, 0, members("lease"), "Abandoned removed the members of expired records")
		n, err := s.DeleteBefore(ctx, time.Now(), 10)
		require.NoError(t, err)
		require.Zero(t, n, "nothing left to delete")
		require.EqualValues(t, 0, members("done"), "DeleteBefore removed the members of expired records")

		// A completion trims, in its shard, the done members completed
		// more than its window and margin (a minute each) before it.
		complete := func(k string, at time.Time) {
			res, err := s.Claim(ctx, within(k, "o", at))
			require.NoError(t, err)
			require.NoError(t, s.Complete(ctx, res.Record.Lease(), okResponse, at))
		}
		listed := func(k string) bool {
			shard, member := digestOf(k)
			for _, idx := range keysLike(t, rdb, prefix, fmt.Sprintf("{%02x}done", shard)) {
				if rdb.ZScore(ctx, idx, member).Err() == nil {
					return true
				}
			}
			return false
		}
		complete("f", old)
		g := sameShard(t, "f")
		complete(g, old.Add(2*time.Minute))
		require.True(t, listed("f"), "f completed within the window and margin")
		complete(sameShard(t, g), old.Add(2*time.Minute+time.Millisecond))
		require.False(t, listed("f"), "a completion past f's window and margin trimmed it")
		require.True(t, listed(g))
	})
}

// digestOf returns the shard and the index member of testScope(key), as
// the Store names records: the first byte and the first 16 bytes (in hex)
// of the SHA-256 of the scope's parts, each preceded by its length.
func digestOf(key string) (byte, string) {
	sc := testScope(key)
	var b []byte
	for _, p := range []string{sc.Principal, sc.Method, sc.Route, sc.Key} {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	d := sha256.Sum256(b)
	return d[0], hex.EncodeToString(d[:16])
}

// sameShard returns a key, other than key, whose record of testScope is in
// key's shard.
func sameShard(t *testing.T, key string) string {
	t.Helper()
	shard, _ := digestOf(key)
	for i := range 100000 {
		k := key + "-" + strconv.Itoa(i)
		if s, _ := digestOf(k); s == shard {
			return k
		}
	}
	t.Fatal("no key in the shard")
	return ""
}

// TestCompletedRecordIsCompact checks what a completed record keeps in
// Redis: only what its readers read (no stored request, no time to live of
// its own, no last update apart from its completion), in Redis's compact
// encoding when its values are small, whatever its request held; and that
// its claim's recovery point survives the completion.
func TestCompletedRecordIsCompact(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, rdb, prefix := newStore(t, b)
		ctx, now := t.Context(), time.Now()
		c := testClaim("compact", "a", now)
		c.Request = bytes.Repeat([]byte("r"), 4096) // over the compact encoding's values
		res, err := s.Claim(ctx, c)
		require.NoError(t, err)
		l := res.Record.Lease()
		require.NoError(t, s.SetRecoveryPoint(ctx, l, "charged", []byte("ch_1"), now))
		require.NoError(t, s.Complete(ctx, l, okResponse, now))
		ks := keysLike(t, rdb, prefix, "*}r:*")
		require.Len(t, ks, 1)
		fields, err := rdb.HKeys(ctx, ks[0]).Result()
		require.NoError(t, err)
		require.ElementsMatch(t, []string{"st", "p", "m", "u", "k", "fp", "fv", "o", "g", "lu", "ca",
			"co", "rs", "rh", "rb", "rp", "rd"}, fields)
		enc, err := rdb.ObjectEncoding(ctx, ks[0]).Result()
		require.NoError(t, err)
		require.Contains(t, []string{"listpack", "ziplist"}, enc, "small values: compact encoding")
		got, err := s.Get(ctx, c.Scope)
		require.NoError(t, err)
		require.Equal(t, "charged", got.RecoveryPoint)
		require.Equal(t, []byte("ch_1"), got.RecoveryData)
		require.Nil(t, got.Request, "the request is dropped at completion")
		require.True(t, got.UpdatedAt.Equal(got.CompletedAt))
	})
}

// TestRecordTooLarge: a claim over WithMaxRecordBytes fails with
// ErrRecordTooLarge (the middleware's 413) and writes nothing.
func TestRecordTooLarge(t *testing.T) {
	s, _, _ := newStore(t, backends[0], redisstore.WithMaxRecordBytes(1000))
	c := testClaim("big", "a", time.Now())
	c.Request = bytes.Repeat([]byte("x"), 1000)
	_, err := s.Claim(t.Context(), c)
	require.ErrorIs(t, err, idempotency.ErrRecordTooLarge)
	_, err = s.Get(t.Context(), c.Scope)
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	c.Request = c.Request[:900]
	_, err = s.Claim(t.Context(), c)
	require.NoError(t, err)
}

// TestNewRefuses checks New's typed refusals of what it cannot run on.
func TestNewRefuses(t *testing.T) {
	_, err := redisstore.New(nil)
	require.ErrorIs(t, err, redisstore.ErrNilClient)

	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	_, err = redisstore.New(c, redisstore.WithPrefix("app:{x}:"))
	require.ErrorIs(t, err, redisstore.ErrInvalidPrefix)

	unbounded := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ReadTimeout: -1})
	t.Cleanup(func() { _ = unbounded.Close() })
	_, err = redisstore.New(unbounded)
	require.ErrorIs(t, err, redisstore.ErrUnboundedClient)

	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	t.Cleanup(func() { _ = ring.Close() })
	_, err = redisstore.New(ring, redisstore.WithReplicas(1, time.Second))
	require.ErrorIs(t, err, redisstore.ErrReplicasUnsupported)

	_, err = redisstore.New(c) // nothing listens there
	var oe *redisstore.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "new", oe.Op)
}

// TestEvictionPolicy runs Redis servers of the test's own: New refuses one
// that may evict records (allkeys-lru, and volatile-lru, since every
// record has an expiry), and accepts, with a warning, one that refuses
// CONFIG.
func TestEvictionPolicy(t *testing.T) {
	for _, policy := range []string{"allkeys-lru", "volatile-lru"} {
		addr := startRedis(t, "--maxmemory-policy", policy)
		_, err := redisstore.New(clientOf(t, addr))
		require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, policy)
		var pe *redisstore.EvictionPolicyError
		require.ErrorAs(t, err, &pe)
		require.Equal(t, policy, pe.Policy)
		require.Equal(t, addr, pe.Addr)
	}
	addr := startRedis(t, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "")
	var logs strings.Builder
	s := openStore(t, clientOf(t, addr), redisstore.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NotNil(t, s)
	require.Contains(t, logs.String(), "cannot check maxmemory-policy")
}

// TestStoreFull fills a Redis of the test's own to its maxmemory
// (noeviction): a claim of a new key fails with ErrStoreFull (503
// CodeStoreFull) and writes nothing, a takeover fails with another error
// and writes nothing, and everything else on the records it holds goes on:
// a replay, a heartbeat, a recovery point, a completion, a release.
func TestStoreFull(t *testing.T) {
	addr := startRedis(t, "--maxmemory-policy", "noeviction")
	rdb := clientOf(t, addr)
	used, err := rdb.Info(t.Context(), "memory").Result()
	require.NoError(t, err)
	var mem int64
	for _, line := range strings.Split(used, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			mem, err = strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
		}
	}
	require.NoError(t, rdb.ConfigSet(t.Context(), "maxmemory", strconv.FormatInt(mem+2<<20, 10)).Err())
	s := openStore(t, rdb)
	ctx := t.Context()
	now := time.Now()
	first, err := s.Claim(ctx, testClaim("first", "a", now))
	require.NoError(t, err)
	done, err := s.Claim(ctx, testClaim("done", "a", now))
	require.NoError(t, err)
	require.NoError(t, s.Complete(ctx, done.Record.Lease(), okResponse, now))
	full := false
	for i := range 100 {
		c := testClaim("fill-"+strconv.Itoa(i), "a", now)
		c.Request = bytes.Repeat([]byte("x"), 64<<10)
		_, err := s.Claim(ctx, c)
		if errors.Is(err, idempotency.ErrStoreFull) {
			full = true
			_, gerr := s.Get(ctx, c.Scope)
			require.ErrorIs(t, gerr, idempotency.ErrNotFound, "a refused claim wrote nothing")
			break
		}
		require.NoError(t, err)
	}
	require.True(t, full, "the store never filled")
	// Freed buffers can take Redis back under its limit between calls: pin
	// it over the limit for what follows.
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", "1mb").Err())
	_, err = s.Claim(ctx, testClaim("new", "a", now))
	require.ErrorIs(t, err, idempotency.ErrStoreFull)
	replay, err := s.Claim(ctx, testClaim("done", "b", now))
	require.NoError(t, err)
	require.Equal(t, idempotency.Completed, replay.Record.State)
	_, err = s.Claim(ctx, testClaim("first", "c", now.Add(time.Hour))) // a takeover: its lease ended
	require.Error(t, err)
	require.NotErrorIs(t, err, idempotency.ErrStoreFull, "ErrStoreFull is for new keys only")
	got, err := s.Get(ctx, testScope("first"))
	require.NoError(t, err)
	require.Equal(t, "a", got.Owner, "the refused takeover wrote nothing")
	l := first.Record.Lease()
	require.NoError(t, s.Heartbeat(ctx, l, now.Add(time.Minute)))
	require.NoError(t, s.SetRecoveryPoint(ctx, l, "order", bytes.Repeat([]byte("d"), 1<<10), now))
	require.NoError(t, s.Complete(ctx, l, okResponse, now))
	got, err = s.Get(ctx, l.Scope)
	require.NoError(t, err)
	require.Equal(t, idempotency.Completed, got.State)
	fill, err := s.Abandoned(ctx, now.Add(time.Hour), 1)
	require.NoError(t, err)
	require.Len(t, fill, 1)
	require.NoError(t, s.Release(ctx, fill[0].Lease()))
}

// TestReplicasWait: with WithReplicas, a write that no replica
// acknowledges in time fails with a *ReplicationError (ErrNotReplicated),
// applied on the primary; a claim that wrote nothing (the record exists)
// waits for nothing; with a replica of the test's own, writes succeed.
func TestReplicasWait(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		s, _, _ := newStore(t, b, redisstore.WithReplicas(1, 50*time.Millisecond))
		ctx := t.Context()
		now := time.Now()
		_, err := s.Claim(ctx, testClaim("w", "a", now))
		require.ErrorIs(t, err, redisstore.ErrNotReplicated)
		var re *redisstore.ReplicationError
		require.ErrorAs(t, err, &re)
		require.Equal(t, redisstore.ReplicationError{Op: "claim", Want: 1, Got: 0}, *re)
		rec, err := s.Get(ctx, testScope("w"))
		require.NoError(t, err, "the claim is applied on the primary")
		res, err := s.Claim(ctx, testClaim("w", "b", now))
		require.NoError(t, err, "a claim that writes nothing waits for nothing")
		require.Equal(t, idempotency.ClaimExisting, res.Outcome)
		require.ErrorIs(t, s.Complete(ctx, rec.Lease(), okResponse, now), redisstore.ErrNotReplicated)
		require.ErrorIs(t, s.Complete(ctx, rec.Lease(), okResponse, now), idempotency.ErrLeaseLost,
			"a refused write is not a replication failure")
	})
	t.Run("with_replica", func(t *testing.T) {
		primary := startRedis(t)
		_, port, _ := strings.Cut(primary, ":")
		replica := startRedis(t, "--replicaof", "127.0.0.1", port)
		rc := clientOf(t, replica)
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(rc.Info(t.Context(), "replication").Val(), "master_link_status:up") {
			require.True(t, time.Now().Before(deadline), "the replica did not connect")
			time.Sleep(20 * time.Millisecond)
		}
		s := openStore(t, clientOf(t, primary), redisstore.WithReplicas(1, 5*time.Second))
		res, err := s.Claim(t.Context(), testClaim("w", "a", time.Now()))
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), res.Record.Lease(), okResponse, time.Now()))
		rs := openStore(t, rc)
		got, err := rs.Get(t.Context(), testScope("w"))
		require.NoError(t, err, "the replica holds the record")
		require.Equal(t, idempotency.Completed, got.State)
	})
}

// TestDeleteBeforeBatches deletes a backlog in the Reaper's batches of 100:
// each shard lists only a share of the limit, and a batch still reaches it.
func TestDeleteBeforeBatches(t *testing.T) {
	s, _, _ := newStore(t, backends[0])
	ctx := t.Context()
	old := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	for i := range 250 {
		res, err := s.Claim(ctx, testClaim("old-"+strconv.Itoa(i), "o", old))
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, res.Record.Lease(), okResponse, old))
	}
	for _, want := range []int{100, 100, 50, 0} {
		n, err := s.DeleteBefore(ctx, old.Add(time.Hour), 100)
		require.NoError(t, err)
		require.Equal(t, want, n)
	}
}

// TestReadsGoToThePrimary gives the Store a client that sends read-only
// commands to a replica (ClusterOptions.ReadOnly), over two servers of the
// test's own: a primary and, as its "replica", a server that never receives
// the writes (a replica that lags without end). Get still reads what the
// primary holds: the middleware decides from what it reads.
func TestReadsGoToThePrimary(t *testing.T) {
	primary, lagging := startRedis(t), startRedis(t)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		ReadOnly:              true,
		ContextTimeoutEnabled: true,
		ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) {
			return []redis.ClusterSlot{{Start: 0, End: 16383,
				Nodes: []redis.ClusterNode{{Addr: primary}, {Addr: lagging}}}}, nil
		},
	})
	t.Cleanup(func() { _ = rdb.Close() })
	s := openStore(t, rdb)
	res, err := s.Claim(t.Context(), testClaim("k", "a", time.Now()))
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	rec, err := s.Get(t.Context(), testScope("k"))
	require.NoError(t, err, "Get read the replica")
	require.Equal(t, "a", rec.Owner)
	require.Zero(t, clientOf(t, lagging).DBSize(t.Context()).Val(), "the replica has nothing")
}
