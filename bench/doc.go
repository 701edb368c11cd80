// Package bench measures saferetry side by side with the retry libraries a
// user would otherwise pick: a bare net/http Transport,
// github.com/hashicorp/go-retryablehttp, github.com/failsafe-go/failsafe-go
// (failsafehttp) and github.com/avast/retry-go/v4.
//
// It is a separate Go module (its go.mod replaces the saferetry module with
// the parent directory) so that the peers never enter saferetry's own
// go.mod. The benchmarks live in the _test.go files; the harness in this
// package builds the contenders (Contenders), the loopback servers and the
// in-memory base transport that all of them share. Run ./run.sh for a full,
// interleaved run that writes RESULTS.md.
//
// Nothing here is part of the saferetry API. The harness is not safe for use
// outside of benchmarks and tests: servers and transports are built per
// benchmark and closed by it.
package bench
