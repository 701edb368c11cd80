// Command gateserver is the server process of the cross-process
// concurrency gate on Redis (gate_test.go in package redisstore): the
// shared gate server (idempotency/internal/gateserver) over the Redis
// store. Its handler counts its executions in Redis (INCR, an external side
// effect that nothing rolls back) and appends one charge to a list.
// Several processes share one Redis and one prefix; the test counts both.
//
// It prints "listening on HOST:PORT" on stdout once it accepts connections
// and runs until it is killed or receives SIGINT/SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency/internal/gateserver"
	"github.com/saferetry/saferetry/idempotency/redisstore"
	"github.com/saferetry/saferetry/idempotency/redisstore/internal/rclient"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	redisAddr := flag.String("redis", "",
		"Redis address (with -cluster: the Cluster's addresses, comma-separated)")
	cluster := flag.Bool("cluster", false, "the addresses are a Redis Cluster's")
	prefix := flag.String("prefix", "", "key prefix of the store and of the side effects")
	work := flag.Duration("work", 100*time.Millisecond,
		"time the handler spends after its side effect")
	flag.Parse()
	if err := run(*addr, *redisAddr, *cluster, *prefix, *work); err != nil {
		log.Fatal(err)
	}
}

func run(addr, redisAddr string, cluster bool, prefix string, work time.Duration) error {
	if redisAddr == "" || prefix == "" {
		return errors.New("-redis and -prefix are required")
	}
	rdb := rclient.Open(redisAddr, cluster)
	defer rdb.Close()
	// The tests' Redis servers keep nothing on disk: WithMemoryOnly accepts them.
	store, err := redisstore.New(rdb, redisstore.WithPrefix(prefix+"idem:"),
		redisstore.WithMemoryOnly(true))
	if err != nil {
		return err
	}
	defer store.Close()
	return gateserver.Run(addr, store, charges{rdb: rdb, prefix: prefix}, work)
}

// charges counts the executions and lists the charges under prefix.
type charges struct {
	rdb    redis.UniversalClient
	prefix string
}

func (c charges) Execution(ctx context.Context, _ string, _ int) error {
	return c.rdb.Incr(ctx, c.prefix+"executions").Err()
}

func (c charges) Charge(ctx context.Context, key string, pid int) (int64, error) {
	return c.rdb.RPush(ctx, c.prefix+"charges", fmt.Sprintf("%s/%d", key, pid)).Result()
}
