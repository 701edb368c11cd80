//go:build unix

package linearizability

import "golang.org/x/sys/unix"

// sharedClock: monotonic is one time line for every process.
const sharedClock = true

// monotonic reads CLOCK_MONOTONIC, which every process on the machine
// shares: a child process's call and return times and the parent's are on
// one time line.
func monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err) // CLOCK_MONOTONIC exists on every unix Go supports
	}
	return ts.Nano()
}
