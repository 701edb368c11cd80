// Command gateserver is the server process of the cross-process
// concurrency gate on Redis (gate_test.go in package redisstore): POST
// /charges guarded by the idempotency middleware over the Redis store, with
// a handler that counts its executions in Redis (INCR, an external side
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
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/saferetry/saferetry/idempotency"
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
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "gate", nil }),
		idempotency.WithLogger(logger))

	pid := os.Getpid()
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		run, _ := idempotency.FromContext(ctx)
		if err := rdb.Incr(ctx, prefix+"executions").Err(); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		charge := fmt.Sprintf("%s/%d", run.Scope.Key, pid)
		id, err := rdb.RPush(ctx, prefix+"charges", charge).Result()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		select { // the side effect takes a while: others arrive meanwhile
		case <-time.After(work):
		case <-ctx.Done():
			http.Error(w, "canceled", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"charge":%d,"pid":%d}`, id, pid)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("listening on %s\n", ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	}
}
