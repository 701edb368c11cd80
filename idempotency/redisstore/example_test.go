package redisstore_test

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// A payments endpoint guarded over Redis (here a Cluster). The handler's
// own write has a unique key, so that a second run after a crash finds it.
func ExampleNew() {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                      []string{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"},
		ContextTimeoutEnabled:      true,        // the Store's deadlines cut calls
		ClusterStateReloadInterval: time.Second, // a failover's new primary found within seconds
	})
	defer rdb.Close()
	store, err := redisstore.New(rdb, redisstore.WithPrefix("payments:"))
	if err != nil {
		// *EvictionPolicyError for a Redis that may evict records,
		// *PersistenceError for one that keeps nothing on disk.
		fmt.Println(err)
		return
	}
	defer store.Close() // after the server's last request
	mw := idempotency.New(store, idempotency.WithPrincipal(func(r *http.Request) (string, error) {
		return r.Header.Get("X-Account"), nil // what your authentication verified
	}))
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run, _ := idempotency.FromContext(r.Context())
		order, err := run.Phase(r.Context(), "order", func(ctx context.Context) ([]byte, error) {
			k := "orders:" + run.DownstreamKey("order") // the same in every run of the request
			if err := rdb.SetNX(ctx, k, "ord_1", 0).Err(); err != nil {
				return nil, err
			}
			return rdb.Get(ctx, k).Bytes()
		})
		if err != nil {
			http.Error(w, "storage failed", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(order)
	})
	http.Handle("POST /payments", mw.Wrap(pay))
}

// An operator's program that ends a quarantine (see the package
// documentation): after Redis lost records, claims of new keys are refused
// until this runs, accepting that a retried request whose record was lost
// runs again. It opens the Store with the servers' client options and
// prefix.
func ExampleStore_Rearm() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true})
	defer rdb.Close()
	store, err := redisstore.New(rdb, redisstore.WithPrefix("payments:"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := store.Rearm(ctx); err != nil {
		fmt.Println(err)
	}
}
