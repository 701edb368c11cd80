package idempotencytest_test

import (
	"path"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// notTransactor is a memory store seen only as an idempotency.Store: its
// Begin is hidden, as a store that is no Transactor has none.
type notTransactor struct{ idempotency.Store }

// TestStore registers the Unit subtests for a Transactor and none for
// another store; no subtest of either run is skipped, and both run the
// Middleware subtests.
func TestStoreRegistersTheUnitSubtestsForATransactorOnly(t *testing.T) {
	units := []string{"UnitCommitVisibility", "UnitRollback", "UnitLeaseLostAtCommit",
		"UnitRaceWithTakeover"}
	for _, tc := range []struct {
		name  string
		store func() idempotency.Store
		units []string
	}{
		{"transactor", func() idempotency.Store { return memstore.New() }, units},
		{"not-transactor", func() idempotency.Store { return notTransactor{memstore.New()} }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var ran, skipped []string
			idempotencytest.TestStore(t, func(t *testing.T) idempotency.Store {
				mu.Lock()
				ran = append(ran, path.Base(t.Name()))
				mu.Unlock()
				t.Cleanup(func() {
					if t.Skipped() {
						mu.Lock()
						skipped = append(skipped, path.Base(t.Name()))
						mu.Unlock()
					}
				})
				return tc.store()
			})
			mu.Lock()
			defer mu.Unlock()
			gotUnits := slices.DeleteFunc(slices.Clone(ran), func(name string) bool {
				return !strings.HasPrefix(name, "Unit")
			})
			if !slices.Equal(gotUnits, tc.units) {
				t.Errorf("Unit subtests run: %q, want %q", gotUnits, tc.units)
			}
			if len(skipped) > 0 {
				t.Errorf("subtests skipped: %q", skipped)
			}
			if !slices.Contains(ran, "MiddlewareCompletionAnswerLost") {
				t.Errorf("the Middleware subtests did not run: %q", ran)
			}
		})
	}
}
