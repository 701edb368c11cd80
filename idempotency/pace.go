package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// maxYield bounds one pause of a background job.
const maxYield = time.Minute

// yield is how the Reaper and the Completer give way to live traffic: after
// a step that took took (one DeleteBefore batch; one record resumed), the
// job waits as long again (at most maxYield) before its next step, so that
// it keeps at most half of the store's time, and less of it the slower the
// store answers, since its steps then take longer. It returns ctx's error
// when ctx ends first.
func yield(ctx context.Context, took time.Duration) error {
	return wait.Sleep(ctx, min(took, maxYield))
}

// every runs f in a goroutine at once and then again after the pause f
// returns, until ctx ends or stop is called; stop cancels f's context and
// waits for the goroutine to return. It runs the Completer and the Reaper.
func every(ctx context.Context, f func(ctx context.Context) (pause time.Duration)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if wait.Sleep(ctx, f(ctx)) != nil {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// errNotSweeper is the error of the runs of a Completer or a Reaper whose
// store lists no records.
var errNotSweeper = fmt.Errorf("idempotency: the store lists no records (not a Sweeper): %w",
	errors.ErrUnsupported)

// sweeps returns nil when the background jobs can run over m's store, and
// otherwise why they cannot.
func (m *Middleware) sweeps() error {
	switch {
	case m.g.store == nil:
		return errNilStore
	case m.g.sweeper == nil:
		return errNotSweeper
	}
	return nil
}
