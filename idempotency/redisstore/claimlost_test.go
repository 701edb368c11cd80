package redisstore_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// A claim whose answer is lost: Redis runs the claim's script, and a proxy
// closes the connection instead of forwarding its reply. go-redis is told
// not to send the script again (MaxRetries -1), so the Store reports the
// loss. The middleware reads the record back: it holds the claim's owner
// token, so the request (or the call of Do) runs, once, and is stored; the
// retry gets the replay, not 409 for a lease that nobody holds
// (idempotencytest.TestClaimAnswerLost). On a Redis Cluster every node is
// reached through a proxy of its own.
func TestClaimWhoseAnswerIsLost(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client func(t *testing.T, proxies *nodeProxies) redis.UniversalClient
	}{
		{"standalone", func(t *testing.T, proxies *nodeProxies) redis.UniversalClient {
			return redis.NewClient(&redis.Options{Addr: redisAddr(t), MaxRetries: -1,
				Dialer: proxies.dial, ContextTimeoutEnabled: true})
		}},
		{"cluster", func(t *testing.T, proxies *nodeProxies) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: clusterAddrs(t),
				MaxRetries: -1, Dialer: proxies.dial, ContextTimeoutEnabled: true})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proxies := &nodeProxies{t: t, byNode: map[string]*faultProxy{}}
			rdb := tc.client(t, proxies)
			t.Cleanup(func() { _ = rdb.Close() })
			// No check of the Store's own: its scripts would take the
			// dropped reply meant for a claim's.
			s := openStore(t, rdb, redisstore.WithPrefix(freshPrefix(t, rdb)),
				redisstore.WithCheckInterval(time.Hour))
			idempotencytest.TestClaimAnswerLost(t, s, func() { proxies.dropNextReply(rdb) },
				proxies.dropped)
		})
	}
}

// nodeProxies puts a faultProxy in front of every Redis node a client
// dials.
type nodeProxies struct {
	t      *testing.T
	mu     sync.Mutex
	byNode map[string]*faultProxy
}

func (n *nodeProxies) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	n.mu.Lock()
	p := n.byNode[addr]
	if p == nil {
		p = newFaultProxy(n.t, addr)
		n.byNode[addr] = p
	}
	n.mu.Unlock()
	var d net.Dialer
	return d.DialContext(ctx, network, p.addr())
}

// dropNextReply makes the reply to the next script each node runs be lost
// with its connection, after reaching every primary once (so that each has
// its proxy). Only the node of the test's one key runs scripts.
func (n *nodeProxies) dropNextReply(rdb redis.UniversalClient) {
	n.t.Helper()
	ctx := n.t.Context()
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		require.NoError(n.t, c.ForEachMaster(ctx, func(ctx context.Context,
			m *redis.Client) error {
			return m.Ping(ctx).Err()
		}))
	default:
		require.NoError(n.t, rdb.Ping(ctx).Err())
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, p := range n.byNode {
		p.dropReplies(1)
	}
}

// dropped returns how many replies the proxies dropped.
func (n *nodeProxies) dropped() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	var sum int64
	for _, p := range n.byNode {
		sum += p.dropped.Load()
	}
	return sum
}
