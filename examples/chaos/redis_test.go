package main

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// redisEnv returns the variable's value, or skips the test (fails it in CI,
// where SAFERETRY_REQUIRE_REDIS is set).
func redisEnv(t *testing.T, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		if os.Getenv("SAFERETRY_REQUIRE_REDIS") != "" {
			t.Fatalf("%s not set but SAFERETRY_REQUIRE_REDIS is", name)
		}
		t.Skipf("%s not set: skipping the demo on Redis", name)
	}
	return v
}

func TestRunRedis(t *testing.T) {
	cfg := shortConfig(t, 2500*time.Millisecond)
	cfg.Store, cfg.DSN = "redis", redisEnv(t, "SAFERETRY_REDIS_ADDR")
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)
	require.Contains(t, out, "store redis")
}

func TestRunRedisCluster(t *testing.T) {
	cfg := shortConfig(t, 2500*time.Millisecond)
	cfg.Store, cfg.DSN = "redis-cluster", redisEnv(t, "SAFERETRY_REDIS_CLUSTER_ADDRS")
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)
	require.Contains(t, out, "store redis-cluster")
}

func TestRunRedisClusterNeedsAddresses(t *testing.T) {
	t.Setenv("SAFERETRY_REDIS_CLUSTER_ADDRS", "")
	cfg, err := parseFlags([]string{"-store", "redis-cluster"}, os.Stderr)
	require.NoError(t, err)
	_, err = openBackend(t.Context(), cfg.Store, cfg.DSN, false)
	require.ErrorContains(t, err, "-dsn")
	t.Setenv("SAFERETRY_REDIS_ADDR", "")
	cfg, err = parseFlags([]string{"-store", "redis"}, os.Stderr)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:6379", cfg.DSN)
}
