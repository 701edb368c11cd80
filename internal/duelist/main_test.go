package duelist

import (
	"testing"

	"go.uber.org/goleak"
)

// The lists' timers run Expire in goroutines of their own: none may be left
// behind.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
