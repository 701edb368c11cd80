package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// openRedis opens the Redis backend: the idempotency records (redisstore)
// and the payments, both under a fresh key prefix on the Redis at addrs
// (one address; with cluster, the Cluster's seed addresses). The demo
// starts no Redis: it needs one running (.ci/redis-cluster.sh starts a
// Cluster on loopback). close deletes the run's keys, unless keep is set.
//
// A payment is one list entry under its key (RPUSH), written by the handler
// outside any transaction with the record: Redis has none to share. The run
// counts the entries, so a second execution of one key would show as a
// duplicate.
func openRedis(ctx context.Context, addrs string, cluster, keep bool) (*backend, error) {
	if addrs == "" {
		return nil, errors.New("-store redis-cluster needs -dsn (or SAFERETRY_REDIS_CLUSTER_ADDRS): " +
			"the Cluster's addresses, comma-separated, e.g. 127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002")
	}
	var rdb redis.UniversalClient
	if cluster {
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(addrs, ","),
			ContextTimeoutEnabled: true, PoolSize: 64})
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: addrs, ContextTimeoutEnabled: true, PoolSize: 64})
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	prefix := "chaos:" + hex.EncodeToString(rnd[:]) + ":"
	// The demo's Redis (this machine's, CI's) keeps nothing on disk:
	// WithMemoryOnly accepts it. A store whose records must survive a
	// restart leaves it out, and New then refuses such a Redis.
	st, err := redisstore.New(rdb, redisstore.WithPrefix(prefix+"idem:"),
		redisstore.WithMemoryOnly(true))
	if err != nil {
		_ = rdb.Close()
		return nil, fmt.Errorf("redis at %s: %w", addrs, err)
	}
	where := "keys " + prefix + "*, deleted at exit; -keep keeps them"
	if keep {
		where = "keys " + prefix + "*, kept by -keep"
	}
	return &backend{store: st, redis: rdb, prefix: prefix, where: where, close: func() {
		_ = st.Close()
		if !keep {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = forEachPrimary(ctx, rdb, func(ctx context.Context, c *redis.Client) error {
				iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
				for iter.Next(ctx) {
					c.Del(ctx, iter.Val())
				}
				return iter.Err()
			})
		}
		_ = rdb.Close()
	}}, nil
}

// forEachPrimary runs f on the standalone client or on every Cluster primary.
func forEachPrimary(ctx context.Context, rdb redis.UniversalClient, f func(context.Context, *redis.Client) error) error {
	if c, ok := rdb.(*redis.ClusterClient); ok {
		return c.ForEachMaster(ctx, f)
	}
	return f(ctx, rdb.(*redis.Client))
}

// payKey is the list of key's payments.
func (b *backend) payKey(key string) string { return b.prefix + "pay:" + key }

// redisSideEffects returns the payments per idempotency key.
func (b *backend) redisSideEffects(ctx context.Context) (map[string][]int64, error) {
	out := map[string][]int64{}
	var (
		mu   sync.Mutex // ForEachMaster runs f on the primaries at once
		keys []string
	)
	err := forEachPrimary(ctx, b.redis, func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, b.prefix+"pay:*", 1000).Iterator()
		var found []string
		for iter.Next(ctx) {
			found = append(found, iter.Val())
		}
		if err := iter.Err(); err != nil {
			return err
		}
		mu.Lock()
		keys = append(keys, found...)
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, k := range keys {
		ids, err := b.redis.LRange(ctx, k, 0, -1).Result()
		if err != nil {
			return nil, err
		}
		for _, s := range ids {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return nil, err
			}
			key := strings.TrimPrefix(k, b.prefix+"pay:")
			out[key] = append(out[key], id)
		}
	}
	return out, nil
}

// createInRedis is createPayment's write on Redis: a payment id (INCR) and
// one entry in the key's list.
func (a *api) createInRedis(w http.ResponseWriter, r *http.Request, key string, p paymentRequest) {
	ctx := r.Context()
	id, err := a.b.redis.Incr(ctx, a.b.prefix+"payment-id").Result()
	if err == nil {
		err = a.b.redis.RPush(ctx, a.b.payKey(key), id).Err()
	}
	if err != nil {
		http.Error(w, "storage failed", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(paymentResponse{ID: id, Status: "captured", Order: p.Order, AmountCents: p.AmountCents})
}
