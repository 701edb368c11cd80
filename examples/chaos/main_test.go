package main

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that the demo leaves no goroutine behind. One exception:
// toxiproxy v2.5.0 itself can leave a toxic stub blocked on a channel send
// when a toxic is removed while its link is closing (its NoopToxic.Pipe);
// that goroutine is the library's, not the demo's, and holds no connection.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*NoopToxic).Pipe"))
}
