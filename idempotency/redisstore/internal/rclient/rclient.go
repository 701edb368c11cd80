// Package rclient opens the Redis client of the redisstore test servers
// (internal/gateserver, internal/phaseserver) from their flags: one
// address, or a Cluster's comma-separated addresses.
package rclient

import (
	"strings"

	"github.com/redis/go-redis/v9"
)

// Open returns a client for addr (standalone) or, with cluster, for the
// Cluster whose seed addresses addr lists, comma-separated.
func Open(addr string, cluster bool) redis.UniversalClient {
	if cluster {
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: strings.Split(addr, ","), ContextTimeoutEnabled: true,
		})
	}
	return redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
}
