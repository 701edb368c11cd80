// Package wait holds the one context-aware sleep of the module, shared by
// the client's retry loop, the server middleware and idemcheck: a wait
// that a caller's cancellation or deadline always ends.
package wait

import (
	"context"
	"time"
)

// Sleep waits for d, or until ctx ends, and returns ctx.Err() in that case
// (nil when d passed). A d <= 0 does not wait: it returns ctx.Err().
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
