package natsconsumer_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(childMain())
	}
	// toxiproxy v2.5.0 can leave a toxic's goroutine blocked on a channel
	// send when the toxic is removed while its link is closing (its
	// NoopToxic.Pipe); it is the library's and holds no connection.
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*NoopToxic).Pipe"))
}
