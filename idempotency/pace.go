package idempotency

import (
	"context"
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
