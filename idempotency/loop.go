package idempotency

import (
	"context"
	"sync"
	"time"
)

// runEvery runs once in a background goroutine: immediately, then on every
// tick of newTicker(interval), until ctx is done or the returned stop is
// called. stop cancels the loop's context (a run in progress sees it) and
// waits for the goroutine to return; it is safe to call more than once and
// from several goroutines. The Completer and the Reaper share it.
func runEvery(ctx context.Context, newTicker func(time.Duration) (<-chan time.Time, func()),
	interval time.Duration, once func(ctx context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	tick, stopTicker := newTicker(interval)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer stopTicker()
		for {
			once(ctx)
			select {
			case <-ctx.Done():
				return
			case <-tick:
			}
		}
	}()
	var o sync.Once
	return func() {
		o.Do(cancel)
		<-done
	}
}
