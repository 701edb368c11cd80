package redisstore_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// startSentinel starts a Sentinel of the test's own (redis-server
// --sentinel) that monitors the primary at addr as "m", and stops it at
// cleanup.
func startSentinel(t *testing.T, primary string) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	host, pport, _ := strings.Cut(primary, ":")
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf") // Sentinel rewrites its file
	require.NoError(t, os.WriteFile(conf, []byte("port "+strconv.Itoa(port)+"\nbind 127.0.0.1\ndir "+dir+
		"\nsentinel monitor m "+host+" "+pport+" 1\n"), 0o600))
	cmd := exec.Command(bin, conf, "--sentinel")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	addr := "127.0.0.1:" + strconv.Itoa(port)
	c := redis.NewSentinelClient(&redis.Options{Addr: addr})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if a, err := c.GetMasterAddrByName(context.Background(), "m").Result(); err == nil && len(a) == 2 {
			break
		}
		require.True(t, time.Now().Before(deadline), "sentinel on %s did not start", addr)
		time.Sleep(20 * time.Millisecond)
	}
	return addr
}

// TestSentinel runs the conformance suite through Sentinel (a
// FailoverClient, which finds the primary through a Sentinel of the test's
// own), and WAIT on the primary it finds.
func TestSentinel(t *testing.T) {
	primary := startRedis(t)
	sentinel := startSentinel(t, primary)
	open := func(t *testing.T) *redis.Client {
		rdb := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "m", SentinelAddrs: []string{sentinel},
			ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
	idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
		rdb := open(t)
		s := openStore(t, rdb, redisstore.WithPrefix(freshPrefix(t, rdb)))
		return s
	})
	t.Run("wait", func(t *testing.T) {
		s := openStore(t, open(t), redisstore.WithReplicas(1, 20*time.Millisecond))
		_, err := s.Claim(t.Context(), testClaim("w", "a", time.Now()))
		require.ErrorIs(t, err, redisstore.ErrNotReplicated, "the primary has no replica")
	})
}
