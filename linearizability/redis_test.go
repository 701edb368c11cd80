package linearizability

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

const (
	redisSkip   = "SAFERETRY_REDIS_ADDR not set (e.g. 127.0.0.1:6379): skipping the Redis check"
	clusterSkip = "SAFERETRY_REDIS_CLUSTER_ADDRS not set (e.g. 127.0.0.1:7000,127.0.0.1:7001," +
		"127.0.0.1:7002; .ci/redis-cluster.sh starts one): skipping the Redis Cluster check"
)

// redisEnv returns the variable's value, or skips t with skip; with
// SAFERETRY_REQUIRE_REDIS set (CI), a missing variable fails t instead.
func redisEnv(t *testing.T, name, skip string) string {
	v := os.Getenv(name)
	if v == "" {
		if os.Getenv("SAFERETRY_REQUIRE_REDIS") != "" {
			t.Fatal(name + " not set but SAFERETRY_REQUIRE_REDIS is")
		}
		t.Skip(skip)
	}
	return v
}

// redisShared is what a child process needs to open the same records: the
// deployment's addresses and the run's key prefix (backend.shared, as JSON).
type redisShared struct {
	Cluster bool     `json:"cluster,omitempty"`
	Addrs   []string `json:"addrs"`
	Prefix  string   `json:"prefix"`
}

// redisClient opens a client of the deployment; dial, when not nil,
// replaces its dialer. go-redis's own retries stay on: a call whose
// connection fails is sent again, as in production.
func redisClient(sh redisShared,
	dial func(ctx context.Context, network, addr string) (net.Conn, error)) redis.UniversalClient {
	if sh.Cluster {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: sh.Addrs,
			ContextTimeoutEnabled: true, Dialer: dial})
	}
	return redis.NewClient(&redis.Options{Addr: sh.Addrs[0], ContextTimeoutEnabled: true,
		Dialer: dial})
}

func openRedis(t *testing.T) *backend {
	addr := redisEnv(t, "SAFERETRY_REDIS_ADDR", redisSkip)
	return openRedisDeployment(t, redisShared{Addrs: []string{addr}})
}

func openRedisCluster(t *testing.T) *backend {
	addrs := redisEnv(t, "SAFERETRY_REDIS_CLUSTER_ADDRS", clusterSkip)
	return openRedisDeployment(t, redisShared{Cluster: true, Addrs: strings.Split(addrs, ",")})
}

// openRedisDeployment makes a fresh key prefix on the deployment, whose
// keys are deleted at cleanup, and two stores on it: one direct, one whose
// connections go through toxiproxy (one proxy per server: a Cluster
// client dials the nodes that CLUSTER SLOTS names, each through its
// proxy). killConn ends, with CLIENT KILL, a direct connection that has a
// call in flight (its command written, no reply read yet).
func openRedisDeployment(t *testing.T, sh redisShared) *backend {
	sh.Prefix = "lincheck:" + randHex(6) + ":"
	admins := map[string]*redis.Client{}
	for _, a := range sh.Addrs {
		c := redis.NewClient(&redis.Options{Addr: a, ContextTimeoutEnabled: true})
		admins[a] = c
		t.Cleanup(func() { _ = c.Close() })
	}
	t.Cleanup(func() { deleteRedisPrefix(admins, sh.Prefix) })

	conns := &connSet{conns: map[*trackedConn]bool{}}
	direct := redisClient(sh, conns.dial)
	t.Cleanup(func() { _ = direct.Close() })
	// The tests' Redis servers keep nothing on disk: WithMemoryOnly accepts them.
	s, err := redisstore.New(direct, redisstore.WithPrefix(sh.Prefix), redisstore.WithMemoryOnly(true))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })

	var proxies []*toxiproxy.Proxy
	through := map[string]string{} // server address -> its proxy's
	for _, a := range sh.Addrs {
		p := startProxy(t, a)
		proxies = append(proxies, p)
		through[a] = p.Listen
	}
	var d net.Dialer
	proxied := redisClient(sh, func(ctx context.Context, network, addr string) (net.Conn, error) {
		if p, ok := through[addr]; ok {
			addr = p
		}
		return d.DialContext(ctx, network, addr)
	})
	t.Cleanup(func() { _ = proxied.Close() })
	faulty, err := redisstore.New(proxied, redisstore.WithPrefix(sh.Prefix), redisstore.WithMemoryOnly(true))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = faulty.Close() })

	rnd := rand.New(rand.NewPCG(8, 0)) // killConn runs in one goroutine
	kill := func(ctx context.Context) (bool, error) {
		c := conns.busy(rnd)
		if c == nil {
			return false, nil
		}
		admin := admins[c.server]
		if admin == nil {
			return false, nil // a node the seed addresses do not name
		}
		n, err := admin.ClientKillByFilter(ctx, "ADDR", c.LocalAddr().String()).Result()
		return n > 0, err
	}
	shared, err := json.Marshal(sh)
	if err != nil {
		t.Fatal(err)
	}
	return &backend{store: s, faulty: faulty, proxies: proxies, killConn: kill,
		shared: string(shared), faultRounds: 8}
}

// connSet tracks a client's connections, to find one with a call in flight.
type connSet struct {
	mu    sync.Mutex
	conns map[*trackedConn]bool
}

func (cs *connSet) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, server: addr, set: cs}
	cs.mu.Lock()
	cs.conns[tc] = true
	cs.mu.Unlock()
	return tc, nil
}

// busy returns a random connection whose command is written and whose
// reply has not started, or nil.
func (cs *connSet) busy(rnd *rand.Rand) *trackedConn {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	var busy []*trackedConn
	for c := range cs.conns {
		if c.inFlight.Load() {
			busy = append(busy, c)
		}
	}
	if len(busy) == 0 {
		return nil
	}
	slices.SortFunc(busy, func(a, b *trackedConn) int { // map order is random: sort, then draw
		return strings.Compare(a.LocalAddr().String(), b.LocalAddr().String())
	})
	return busy[rnd.IntN(len(busy))]
}

// trackedConn is a client connection that knows whether a call is in
// flight: set by a write, cleared by the first bytes read back.
type trackedConn struct {
	net.Conn
	server   string
	set      *connSet
	inFlight atomic.Bool
}

func (c *trackedConn) Write(b []byte) (int, error) {
	c.inFlight.Store(true)
	return c.Conn.Write(b)
}

func (c *trackedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.inFlight.Store(false)
	}
	return n, err
}

func (c *trackedConn) Close() error {
	c.set.mu.Lock()
	delete(c.set.conns, c)
	c.set.mu.Unlock()
	return c.Conn.Close()
}

// reopenRedis opens, in a child process, the store that openRedisDeployment
// described in shared.
func reopenRedis(shared string) (idempotency.Store, func(), error) {
	var sh redisShared
	if err := json.Unmarshal([]byte(shared), &sh); err != nil {
		return nil, nil, err
	}
	rdb := redisClient(sh, nil)
	s, err := redisstore.New(rdb, redisstore.WithPrefix(sh.Prefix), redisstore.WithMemoryOnly(true))
	if err != nil {
		_ = rdb.Close()
		return nil, nil, err
	}
	return s, func() {
		_ = s.Close()
		_ = rdb.Close()
	}, nil
}

// deleteRedisPrefix deletes every key under prefix on every server (never
// FLUSHALL: other tests share them).
func deleteRedisPrefix(servers map[string]*redis.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, c := range servers {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
	}
}
