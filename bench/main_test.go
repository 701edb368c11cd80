package bench

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that the tests leave no goroutine behind. It skips the
// check when benchmarks ran: the failure benchmarks measure peers that leak
// connections (and their goroutines) on purpose.
func TestMain(m *testing.M) {
	code := m.Run()
	if f := flag.Lookup("test.bench"); code == 0 && (f == nil || f.Value.String() == "") {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
