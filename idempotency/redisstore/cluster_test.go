package redisstore_test

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// ownCluster is a Redis Cluster of the test's own: three primaries with a
// replica each, on free loopback ports (each bus on a port of its own),
// keeping nothing on disk, with a node timeout of a second, so that a
// replica takes over a killed primary within a few seconds.
type ownCluster struct {
	nodes []*redisProc
	addrs []string
}

func startCluster(tb testing.TB) *ownCluster {
	tb.Helper()
	c := &ownCluster{}
	for range 6 {
		n := runRedis(tb, "--cluster-enabled", "yes", "--cluster-port", strconv.Itoa(freePort(tb)),
			"--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf")
		c.nodes = append(c.nodes, n)
		c.addrs = append(c.addrs, n.addr)
	}
	args := append(append([]string{"--cluster", "create"}, c.addrs...),
		"--cluster-replicas", "1", "--cluster-yes")
	out, err := exec.Command("redis-cli", args...).CombinedOutput()
	require.NoError(tb, err, "redis-cli --cluster create: %s", out)
	c.waitReady(tb)
	return c
}

// waitReady waits until every running node sees the cluster ok, with
// three primaries and three replicas, none failing, and every replica's
// link to its primary is up.
func (c *ownCluster) waitReady(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range c.nodes {
		if n.cmd == nil {
			continue
		}
		rdb := redis.NewClient(&redis.Options{Addr: n.addr})
		for !nodeReady(rdb) {
			require.True(tb, time.Now().Before(deadline), "cluster node %s not ready", n.addr)
			time.Sleep(50 * time.Millisecond)
		}
		_ = rdb.Close()
	}
}

func nodeReady(rdb *redis.Client) bool {
	ctx := context.Background()
	info := rdb.ClusterInfo(ctx).Val()
	nodes := rdb.ClusterNodes(ctx).Val()
	repl := rdb.Info(ctx, "replication").Val()
	return strings.Contains(info, "cluster_state:ok") &&
		strings.Count(nodes, "master") == 3 && strings.Count(nodes, "slave") == 3 &&
		!strings.Contains(nodes, "fail") && !strings.Contains(nodes, "handshake") &&
		(strings.Contains(repl, "role:master") || strings.Contains(repl, "master_link_status:up"))
}

// waitReplicated waits until every replica has what its primary has (the
// replication offsets agree), so that a primary killed then loses nothing
// acknowledged.
func (c *ownCluster) waitReplicated(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range c.nodes {
		rdb := redis.NewClient(&redis.Options{Addr: n.addr})
		for !replicated(rdb.Info(context.Background(), "replication").Val()) {
			require.True(tb, time.Now().Before(deadline), "the replicas of %s lag", n.addr)
			time.Sleep(20 * time.Millisecond)
		}
		_ = rdb.Close()
	}
}

// replicated reports whether INFO replication shows a replica, or a
// primary whose replicas all acknowledged its offset.
func replicated(info string) bool {
	if !strings.Contains(info, "role:master") {
		return true
	}
	offset := ""
	var acked []string
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "master_repl_offset:"); ok {
			offset = v
		}
		if strings.HasPrefix(line, "slave") && strings.Contains(line, "offset=") {
			_, v, _ := strings.Cut(line, "offset=")
			v, _, _ = strings.Cut(v, ",")
			acked = append(acked, v)
		}
	}
	for _, a := range acked {
		if a != offset {
			return false
		}
	}
	return true
}

// client returns a Cluster client over the nodes that reloads its slot map
// every reload (0: go-redis's default, 60 s), closed at cleanup.
func (c *ownCluster) client(tb testing.TB, reload time.Duration) *redis.ClusterClient {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.addrs, ContextTimeoutEnabled: true,
		ClusterStateReloadInterval: reload})
	tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func (c *ownCluster) node(addr string) *redisProc {
	for _, n := range c.nodes {
		if n.addr == addr {
			return n
		}
	}
	return nil
}

// primaryOf returns the address of the primary that holds key's record.
func primaryOf(tb testing.TB, rdb *redis.ClusterClient, prefix, key string) string {
	tb.Helper()
	shard, _ := digestOf(key)
	n, err := rdb.MasterForKey(context.Background(), prefix+"{"+hexByte(int(shard))+"}")
	require.NoError(tb, err)
	return n.Options().Addr
}

// keyOn returns a new key whose record lives on the primary at addr, or,
// with off, on another primary.
func keyOn(tb testing.TB, rdb *redis.ClusterClient, addr string, off bool) string {
	tb.Helper()
	for {
		k := "new-" + randHex(6)
		if (primaryOf(tb, rdb, redisstore.DefaultPrefix, k) == addr) != off {
			return k
		}
	}
}

// completeKeys claims and completes n keys named name-0, name-1 and on,
// and returns their claims.
func completeKeys(tb testing.TB, s *redisstore.Store, name string, n int) []idempotency.Claim {
	tb.Helper()
	now := time.Now()
	var cs []idempotency.Claim
	for i := range n {
		c := testClaim(name+"-"+strconv.Itoa(i), "a", now)
		res, err := s.Claim(context.Background(), c)
		require.NoError(tb, err)
		require.NoError(tb, s.Complete(context.Background(), res.Record.Lease(), okResponse, now))
		cs = append(cs, c)
	}
	return cs
}

// untilReplayed replays every claim (same scope and fingerprint, another
// owner) every 50 ms until each answered its completed record, for at most
// limit, and returns how long that took. A replay that acquired the record
// (its request would run again) fails the test.
func untilReplayed(tb testing.TB, s *redisstore.Store, cs []idempotency.Claim,
	limit time.Duration) time.Duration {
	tb.Helper()
	start := time.Now()
	left := cs
	var last error
	for len(left) > 0 {
		require.Less(tb, time.Since(start), limit, "%d of %d replays still fail, the last with %v",
			len(left), len(cs), last)
		var failed []idempotency.Claim
		for _, c := range left {
			c.Owner = "replay"
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			res, err := s.Claim(ctx, c)
			cancel()
			if err != nil {
				last = err
				failed = append(failed, c)
				continue
			}
			require.Equal(tb, idempotency.ClaimExisting, res.Outcome, "%s would run again", c.Scope.Key)
			require.Equal(tb, idempotency.Completed, res.Record.State)
		}
		left = failed
		if len(left) > 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	return time.Since(start)
}

// TestClusterOfOwn runs a Cluster of the test's own, three primaries with
// a replica each:
//   - a replica switched to allkeys-lru refuses claims of new keys within
//     a check, and switching it back lets them go on;
//   - FLUSHALL on one primary quarantines its shards only;
//   - a primary killed: through the client the package documentation gives
//     (ClusterStateReloadInterval: a second; its Store checks nothing, so
//     that no check reloads the slot map), every replay answers again
//     within seconds and none runs its request again; with WithReplicas(1)
//     the promoted primary, which has no replica, refuses new keys with a
//     *ReplicationError (logged by the checks) until the killed node comes
//     back as its replica.
func TestClusterOfOwn(t *testing.T) {
	c := startCluster(t)
	rdb := c.client(t, 0)
	var logs logBuffer
	s := openStore(t, rdb, logs.logger(), redisstore.WithReplicas(1, 100*time.Millisecond),
		redisstore.WithCheckInterval(50*time.Millisecond))
	ctx := t.Context()

	var replica string
	for _, addr := range c.addrs {
		if strings.Contains(clientOf(t, addr).Info(ctx, "replication").Val(), "role:slave") {
			replica = addr
		}
	}
	rc := clientOf(t, replica)
	require.NoError(t, rc.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err())
	eventually(t, "a replica's eviction policy refuses new keys", func() bool {
		_, err := s.Claim(ctx, testClaim("new-"+randHex(4), "a", time.Now()))
		var pe *redisstore.EvictionPolicyError
		return errors.As(err, &pe) && pe.Addr == replica
	})
	require.NoError(t, rc.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	eventually(t, "noeviction again", func() bool {
		_, err := s.Claim(ctx, testClaim("new-"+randHex(4), "a", time.Now()))
		return err == nil
	})

	completeKeys(t, s, "flushed", 48)
	flushed := primaryOf(t, rdb, redisstore.DefaultPrefix, "flushed-0")
	require.NoError(t, clientOf(t, flushed).FlushAll(ctx).Err())
	_, err := s.Claim(ctx, testClaim(keyOn(t, rdb, flushed, false), "a", time.Now()))
	requireForgotten(t, err)
	res, err := s.Claim(ctx, testClaim(keyOn(t, rdb, flushed, true), "a", time.Now()))
	require.NoError(t, err, "the other primaries' shards are not quarantined")
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	require.NoError(t, s.Rearm(ctx))

	fast := c.client(t, time.Second)
	fs := openStore(t, fast, redisstore.WithReplicas(1, 100*time.Millisecond),
		redisstore.WithCheckInterval(time.Hour))
	cs := completeKeys(t, fs, "done", 48)
	victim := primaryOf(t, fast, redisstore.DefaultPrefix, "done-0")
	c.node(victim).kill()
	took := untilReplayed(t, fs, cs, 30*time.Second)
	t.Logf("replays answered again %v after the primary was killed", took.Round(10*time.Millisecond))

	promoted := primaryOf(t, fast, redisstore.DefaultPrefix, "done-0")
	require.NotEqual(t, victim, promoted)
	eventually(t, "a new key on the promoted primary is not replicated", func() bool {
		_, err := fs.Claim(ctx, testClaim(keyOn(t, fast, promoted, false), "a", time.Now()))
		return errors.Is(err, redisstore.ErrNotReplicated)
	})
	eventually(t, "the checks log the missing replica", func() bool {
		return strings.Contains(logs.String(), "fewer replicas than WithReplicas") &&
			strings.Contains(logs.String(), promoted)
	})
	c.node(victim).start() // it rejoins as the promoted primary's replica
	eventually(t, "new keys on the promoted primary, once it has a replica again", func() bool {
		_, err := fs.Claim(ctx, testClaim(keyOn(t, fast, promoted, false), "a", time.Now()))
		return err == nil
	})
}

// BenchmarkClusterFailover kills a primary of a Cluster of its own (three
// primaries with a replica each, node timeout 1 s), once its replica has
// every write (a replica that lags loses the last ones, the prefix's new
// markers among them, and the Store then refuses until Rearm), and
// reports how long
// until the replays of 48 completed keys all answer again: through a
// client with go-redis's default slot map reload (60 s), with the Store's
// checks an hour apart (no check reloads the map) and with their default
// period (each check reads the Cluster's nodes, which reloads it), and
// through a client with ClusterStateReloadInterval: time.Second. One
// cluster per run: run it with -benchtime 1x.
func BenchmarkClusterFailover(b *testing.B) {
	for _, v := range []struct {
		name         string
		reload, each time.Duration
	}{
		{"reload=default/checks=1h", 0, time.Hour},
		{"reload=default/checks=default", 0, 0},
		{"reload=1s/checks=default", time.Second, 0},
	} {
		b.Run(v.name, func(b *testing.B) {
			var total time.Duration
			for range b.N {
				c := startCluster(b)
				rdb := c.client(b, v.reload)
				s := openStore(b, rdb, redisstore.WithLogger(nil), redisstore.WithCheckInterval(v.each))
				cs := completeKeys(b, s, "done", 48)
				c.waitReplicated(b) // a replica that lags would lose records: see TestClusterOfOwn
				c.node(primaryOf(b, rdb, redisstore.DefaultPrefix, "done-0")).kill()
				total += untilReplayed(b, s, cs, 3*time.Minute)
			}
			b.ReportMetric(total.Seconds()/float64(b.N), "s-to-replay")
			b.ReportMetric(0, "ns/op")
		})
	}
}
