//go:build unix

// Command phaseserver is the server process of the crash-recovery tests on
// Redis (crash_test.go in package redisstore): the shared phase server
// (idempotency/internal/phaseserver, which documents the request, the
// phases and the flags -processor, -lease, -crash, -completer and -auth)
// over the Redis store, with atomic phases as a handler writes them on a
// store without transactions: the order phase's write is made idempotent
// by a unique key in its own data (SET NX under the phase's downstream
// key, so that a phase run again after a crash before its commit finds its
// order), and the receipt is a SET NX under the order, before the response
// is stored. Every run of the order phase's function counts itself (INCR),
// so the tests see that a resume skips a committed phase.
//
// It prints "listening on HOST:PORT" on stdout once it accepts connections,
// and runs until it is killed or receives SIGINT/SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/internal/phaseserver"
	"github.com/saferetry/saferetry/idempotency/redisstore"
	"github.com/saferetry/saferetry/idempotency/redisstore/internal/rclient"
)

func main() {
	redisAddr := flag.String("redis", "",
		"Redis address (with -cluster: the Cluster's addresses, comma-separated)")
	cluster := flag.Bool("cluster", false, "the addresses are a Redis Cluster's")
	prefix := flag.String("prefix", "", "key prefix of the store and of the business keys")
	cfg := phaseserver.Flags()
	flag.Parse()
	if err := run(*redisAddr, *cluster, *prefix, *cfg); err != nil {
		log.Fatal(err)
	}
}

func run(redisAddr string, cluster bool, prefix string, cfg phaseserver.Config) error {
	if redisAddr == "" || prefix == "" || cfg.Processor == "" {
		return errors.New("-redis, -prefix and -processor are required")
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
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return phaseserver.Serve(ctx, store, writes{rdb: rdb, prefix: prefix}, cfg)
}

// writes keeps the orders and receipts in Redis under prefix.
type writes struct {
	rdb    redis.UniversalClient
	prefix string
}

func (w writes) Order(ctx context.Context, run *idempotency.Run, id string, amount int64,
	pid int) ([]byte, error) {
	if err := w.rdb.Incr(ctx, w.prefix+"order-runs:"+run.Scope.Key).Err(); err != nil {
		return nil, err
	}
	// The order's unique key is the phase's downstream key: the same in
	// every execution of the request, so a run after a crash before the
	// commit finds the order the first one made.
	k := w.prefix + "order:" + run.DownstreamKey("order")
	mine := fmt.Sprintf("%s/%d/%d/%s", id, amount, pid, run.Scope.Key)
	if err := w.rdb.SetNX(ctx, k, mine, 0).Err(); err != nil {
		return nil, err
	}
	v, err := w.rdb.Get(ctx, k).Result()
	if err != nil {
		return nil, err
	}
	if err := w.rdb.SAdd(ctx, w.prefix+"orders:"+run.Scope.Key, v).Err(); err != nil {
		return nil, err
	}
	return []byte(v), nil
}

// Receipt writes the receipt, unique per order: written again by a run
// that stored no response, it stays the first one.
func (w writes) Receipt(ctx context.Context, _ *idempotency.Run, order, charge []byte,
	pid int) error {
	receipt := fmt.Sprintf("%s/%d", charge, pid)
	return w.rdb.SetNX(ctx, w.prefix+"receipt:"+string(order), receipt, 0).Err()
}
