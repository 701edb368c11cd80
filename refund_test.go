package saferetry

import (
	"context"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// A retry the budget granted but that is never sent gives its tokens back:
// the caller cancels during the wait, the deadline passes before it can
// start, or its preparation fails. Each case sends one 503, is granted a
// transient retry (14 of the bucket's 500 tokens) and then never sends it:
// the bucket is full again.
func TestARetryNeverSentGivesItsTokensBack(t *testing.T) {
	cases := map[string]struct {
		opts   func() []Option
		stop   retry.Reason
		cancel bool
	}{
		"the caller cancels during the wait": {
			opts:   func() []Option { return nil },
			stop:   retry.ReasonCanceled,
			cancel: true,
		},
		"the deadline passes before the retry": {
			// An observer takes the time the wait had left.
			opts: func() []Option {
				return []Option{WithMaxElapsed(2 * time.Second), WithObserver(Observer{
					AttemptDone: func(context.Context, AttemptDoneInfo) { time.Sleep(3 * time.Second) },
				})}
			},
			stop: retry.ReasonDeadline,
		},
		"the retry's preparation fails": {
			opts: func() []Option {
				return []Option{WithPrepare(func(_ *http.Request, attempt int) error {
					if attempt == 2 {
						return errTokenExpired
					}
					return nil
				})}
			},
			stop: retry.ReasonPrepare,
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := &script{statuses: []int{503, 200}}
				base, url := pipeServer(t, srv)
				// The AWS SDKs' bucket: time refills nothing, so that
				// only the refund can fill it again.
				bucket := budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				opts := append([]Option{WithBackoff(jitter.Config{Func: jitter.None, Base: time.Second}),
					WithBudget(bucket)}, tc.opts()...)
				tr := newBubbleTransport(base, opts...)
				done := make(chan error, 1)
				go func() {
					_, err := tr.RoundTrip(get(t, url).WithContext(ctx))
					done <- err
				}()
				synctest.Wait() // attempt 1 answered: the loop waits, or an observer sleeps
				require.Len(t, srv.Hits(), 1)
				assert.Equal(t, 486, bucket.Available(time.Now()), "the retry was granted")
				if tc.cancel {
					cancel()
				}
				err := <-done
				var ex *retry.ExhaustedError
				require.ErrorAs(t, err, &ex)
				assert.Equal(t, tc.stop, ex.Reason)
				assert.Len(t, srv.Hits(), 1, "the retry was never sent")
				assert.Equal(t, 500, bucket.Available(time.Now()), "its tokens are back")
			})
		})
	}
}
