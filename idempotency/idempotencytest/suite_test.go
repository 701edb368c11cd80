package idempotencytest_test

import (
	"path"
	"slices"
	"sync"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// plainStore is a memory store seen only as an idempotency.Store: its
// Begin, Abandoned and DeleteBefore are hidden, as a store that is neither
// a Transactor nor a Sweeper has none.
type plainStore struct{ idempotency.Store }

// sweeperStore is a memory store seen as a Store and a Sweeper only.
type sweeperStore struct {
	idempotency.Store
	idempotency.Sweeper
}

// TestStore registers the Unit subtests for a Transactor only, and those of
// the listings and the background jobs for a Sweeper only; no subtest of
// any run is skipped, and every run has the Middleware subtests that need
// nothing more than a Store.
func TestStoreRegistersTheSubtestsThatApply(t *testing.T) {
	units := []string{"UnitCommitVisibility", "UnitRollback", "UnitLeaseLostAtCommit",
		"UnitRaceWithTakeover"}
	sweeps := []string{"Abandoned", "DeleteBefore", "MiddlewareResumeWithoutCredentials",
		"MiddlewareDurationsAtTheirLimits", "DoCompleterResumes"}
	for _, tc := range []struct {
		name          string
		store         func() idempotency.Store
		units, sweeps []string
	}{
		{"memstore", func() idempotency.Store { return memstore.New() }, units, sweeps},
		{"sweeper", func() idempotency.Store {
			m := memstore.New()
			return sweeperStore{m, m}
		}, nil, sweeps},
		{"plain", func() idempotency.Store { return plainStore{memstore.New()} }, nil, nil},
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
			only := func(names []string) []string {
				return slices.DeleteFunc(slices.Clone(ran), func(name string) bool {
					return !slices.Contains(names, name)
				})
			}
			if got := only(units); !slices.Equal(got, tc.units) {
				t.Errorf("Unit subtests run: %q, want %q", got, tc.units)
			}
			if got := only(sweeps); !slices.Equal(got, tc.sweeps) {
				t.Errorf("subtests of the listings run: %q, want %q", got, tc.sweeps)
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
