package redisstore_test

import (
	"testing"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/redisstore"
)

// TestConformance runs the shared Store conformance suite against a
// standalone Redis and a Redis Cluster, each subtest under a fresh prefix.
// The suite's times are in 2025, so the records' cleanup horizon is a
// century: Redis would otherwise expire them at once by its own clock. The
// Unit subtests skip: the Store is not a Transactor.
func TestConformance(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
			s, _, _ := newStore(t, b, redisstore.WithCleanupHorizon(century))
			return s
		})
	})
}
