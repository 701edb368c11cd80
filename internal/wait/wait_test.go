package wait

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if err := Sleep(t.Context(), time.Minute); err != nil || time.Since(start) != time.Minute {
			t.Fatalf("Sleep(1m) = %v after %v", err, time.Since(start))
		}

		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		start = time.Now()
		if err := Sleep(ctx, time.Hour); err != context.DeadlineExceeded || time.Since(start) != time.Second {
			t.Fatalf("Sleep past the deadline = %v after %v", err, time.Since(start))
		}
		if err := Sleep(ctx, 0); err != context.DeadlineExceeded {
			t.Fatalf("Sleep(0) on an ended context = %v", err)
		}
		if err := Sleep(t.Context(), -time.Second); err != nil {
			t.Fatalf("Sleep(-1s) = %v", err)
		}
	})
}
