package sqlstore_test

import (
	"testing"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
)

// TestConformance runs the shared Store conformance suite (including the
// Unit subtests, since Store is a Transactor) against both dialects, each
// subtest on a fresh SQLite file or a fresh PostgreSQL schema.
func TestConformance(t *testing.T) {
	forEach(t, func(t *testing.T, b backend) {
		idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
			s, _ := newStore(t, b)
			return s
		})
	})
}
