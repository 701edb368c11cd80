package redisstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency/redisstore"
)

const (
	redisSkip   = "SAFERETRY_REDIS_ADDR not set (e.g. 127.0.0.1:6379): skipping Redis tests"
	clusterSkip = "SAFERETRY_REDIS_CLUSTER_ADDRS not set (e.g. 127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002; " +
		".ci/redis-cluster.sh starts one): skipping Redis Cluster tests"
)

// required reports whether CI asked for every Redis test to run
// (SAFERETRY_REQUIRE_REDIS=1): then a missing variable fails the test.
func required() bool { return os.Getenv("SAFERETRY_REQUIRE_REDIS") != "" }

// redisAddr returns SAFERETRY_REDIS_ADDR or skips the test.
func redisAddr(t testing.TB) string {
	t.Helper()
	addr := os.Getenv("SAFERETRY_REDIS_ADDR")
	if addr == "" {
		if required() {
			t.Fatal("SAFERETRY_REDIS_ADDR not set but SAFERETRY_REQUIRE_REDIS is")
		}
		t.Skip(redisSkip)
	}
	return addr
}

// clusterAddrs returns SAFERETRY_REDIS_CLUSTER_ADDRS or skips the test.
func clusterAddrs(t testing.TB) []string {
	t.Helper()
	addrs := os.Getenv("SAFERETRY_REDIS_CLUSTER_ADDRS")
	if addrs == "" {
		if required() {
			t.Fatal("SAFERETRY_REDIS_CLUSTER_ADDRS not set but SAFERETRY_REQUIRE_REDIS is")
		}
		t.Skip(clusterSkip)
	}
	return strings.Split(addrs, ",")
}

// backend is one kind of Redis deployment the tests run on.
type backend struct {
	name   string
	client func(t testing.TB) redis.UniversalClient
}

var backends = []backend{
	{name: "standalone", client: standaloneClient},
	{name: "cluster", client: clusterClient},
}

// forEach runs f once per deployment in a subtest.
func forEach(t *testing.T, f func(t *testing.T, b backend)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { f(t, b) })
	}
}

func standaloneClient(t testing.TB) redis.UniversalClient {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: redisAddr(t), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func clusterClient(t testing.TB) redis.UniversalClient {
	t.Helper()
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: clusterAddrs(t), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// freshPrefix returns a key prefix no other test uses, and deletes its keys
// at cleanup (never FLUSHALL: other tests share the Redis).
func freshPrefix(t testing.TB, rdb redis.UniversalClient) string {
	t.Helper()
	prefix := "test:" + randHex(6) + ":"
	t.Cleanup(func() { deletePrefix(rdb, prefix) })
	return prefix
}

// deletePrefix deletes every key under prefix, on every primary.
func deletePrefix(rdb redis.UniversalClient, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	del := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
		return iter.Err()
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		_ = c.ForEachMaster(ctx, del)
	case *redis.Client:
		_ = del(ctx, c)
	}
}

// newStore returns a Store on b with a fresh prefix (opts after it).
func newStore(t testing.TB, b backend, opts ...redisstore.Option) (*redisstore.Store, redis.UniversalClient, string) {
	t.Helper()
	rdb := b.client(t)
	prefix := freshPrefix(t, rdb)
	return openStore(t, rdb, append([]redisstore.Option{redisstore.WithPrefix(prefix)}, opts...)...), rdb, prefix
}

// openStore returns New(rdb, opts...), closed at cleanup. It accepts a
// memory-only Redis (WithMemoryOnly, before opts): the shared test servers
// and the tests' own keep nothing on disk.
func openStore(t testing.TB, rdb redis.UniversalClient, opts ...redisstore.Option) *redisstore.Store {
	t.Helper()
	s, err := redisstore.New(rdb, append([]redisstore.Option{redisstore.WithMemoryOnly(true)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}
