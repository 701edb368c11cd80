package deadline_test

import (
	"fmt"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/deadline"
)

func ExamplePropagate() {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	overall := now.Add(2500 * time.Millisecond)
	h := http.Header{}
	deadline.Propagate(h, now, overall)
	fmt.Println(h.Get(deadline.Header))
	fmt.Println(deadline.SleepFits(now, overall, 3*time.Second))
	// Output:
	// 2500
	// false
}
