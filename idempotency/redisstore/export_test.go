package redisstore

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
)

// claimScriptUnguarded is claimScript without its guard: a claim that
// would create a record trusts Redis, as a Store without markers would.
// BenchmarkClaimGuard measures the guard against it.
var claimScriptUnguarded = func() *redis.Script {
	const guard, none = "local refused = guard()", "local refused = nil"
	if strings.Count(claimLua, guard) != 1 {
		panic("redisstore: claimLua has no guard to remove")
	}
	return redis.NewScript(strings.Replace(claimLua, guard, none, 1))
}()

// ClaimUnguarded is s.Claim with claimScriptUnguarded.
func ClaimUnguarded(ctx context.Context, s *Store, c idempotency.Claim) (
	idempotency.ClaimResult, error) {
	return s.claim(ctx, c, claimScriptUnguarded)
}
