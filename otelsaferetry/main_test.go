package otelsaferetry

import (
	"net/http"
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that no test leaves a goroutine behind, once the idle
// connections of http.DefaultTransport are closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) { http.DefaultTransport.(*http.Transport).CloseIdleConnections() }))
}
