package budget

import (
	"testing"

	"go.uber.org/goleak"
)

// The package promises to start no goroutines; goleak checks the tests' own too.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
