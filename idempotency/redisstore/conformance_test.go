package redisstore_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// TestConformance runs the shared Store conformance suite against a
// standalone Redis and a Redis Cluster, each subtest under a fresh prefix.
// Its times are in 2025: Redis counts a record's time to live from the
// write, whatever the times the write carries. The Store is not a
// Transactor, so the suite registers no Unit subtest. It runs once more
// over RESP2, in which Lua's false reaches the client as nil, not as false.
func TestConformance(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
			s, _, _ := newStore(t, b)
			return s
		})
	})
	t.Run("standalone-resp2", func(t *testing.T) {
		idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
			rdb := redis.NewClient(&redis.Options{Addr: redisAddr(t), Protocol: 2, ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = rdb.Close() })
			s := openStore(t, rdb, redisstore.WithPrefix(freshPrefix(t, rdb)))
			return s
		})
	})
}
