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
	return runRedis(t, args...).addr
}

// redisProc is a Redis server of the test's own, on a free loopback port,
// that keeps nothing on disk unless args say otherwise. The test can kill
// it and start it again on the same port, with the same arguments and
// directory (a Cluster node finds its nodes.conf there).
type redisProc struct {
	t    testing.TB
	bin  string
	addr string
	args []string
	cmd  *exec.Cmd
}

// runRedis starts a redisProc and kills it at cleanup.
func runRedis(t testing.TB, args ...string) *redisProc {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if required() {
			t.Fatal("redis-server is not on the PATH but SAFERETRY_REQUIRE_REDIS is set")
		}
		t.Skip("redis-server not on the PATH: skipping a test that runs its own Redis")
	}
	port := freePort(t)
	p := &redisProc{t: t, bin: bin, addr: "127.0.0.1:" + strconv.Itoa(port),
		args: append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--dir", t.TempDir()}, args...)}
	t.Cleanup(p.kill)
	p.start()
	return p
}

// freePort returns a loopback port nothing listened on a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// start starts the server and waits until it answers.
func (p *redisProc) start() {
	p.t.Helper()
	p.cmd = exec.Command(p.bin, p.args...)
	require.NoError(p.t, p.cmd.Start())
	c := redis.NewClient(&redis.Options{Addr: p.addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(context.Background()).Err() != nil {
		require.True(p.t, time.Now().Before(deadline), "redis-server on %s did not start", p.addr)
		time.Sleep(20 * time.Millisecond)
	}
}

// kill kills the server (SIGKILL: no shutdown save) and waits for it.
func (p *redisProc) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

func clientOf(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}
