package saferetry

import (
	"fmt"
	"net/http"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that no test leaves a goroutine behind. The idle
// keep-alive connections of http.DefaultTransport (which NewTransport(nil)
// uses) are closed first: what is left is a leak.
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		http.DefaultTransport.(*http.Transport).CloseIdleConnections()
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
