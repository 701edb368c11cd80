package retry

import (
	"testing"

	"go.uber.org/goleak"
)

// The real-error tests start TCP and TLS servers; none may leak goroutines.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
