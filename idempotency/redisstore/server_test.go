package redisstore_test

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// startRedis starts a Redis server of the test's own on a free loopback
// port, with args added to its command line, and stops it at cleanup. The
// tests that change a server's settings (maxmemory, its policy, renamed
// commands, replication) use one, never the shared Redis. It skips, or in
// CI fails, without redis-server on the PATH.
func startRedis(t testing.TB, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if required() {
			t.Fatal("redis-server is not on the PATH but SAFERETRY_REQUIRE_REDIS is set")
		}
		t.Skip("redis-server not on the PATH: skipping a test that runs its own Redis")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	cmd := exec.Command(bin, append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", t.TempDir()}, args...)...)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	addr := "127.0.0.1:" + strconv.Itoa(port)
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(context.Background()).Err() != nil {
		require.True(t, time.Now().Before(deadline), "redis-server on %s did not start", addr)
		time.Sleep(20 * time.Millisecond)
	}
	return addr
}

func clientOf(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}
