//go:build !unix

package linearizability

import "time"

var start = time.Now()

// sharedClock: monotonic is this process's own.
const sharedClock = false

// monotonic is the time since the test binary started: enough within one
// process (the killed-process check needs unix).
func monotonic() int64 { return int64(time.Since(start)) }
