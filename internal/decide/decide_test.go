package decide

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func half() float64 { return 0.5 }

// cfg has the default backoff: bases 50 ms and 1 s, cap 20 s.
var cfg = Config{MaxAttempts: 3, MaxRetryAfter: 30 * time.Second}

// input is an attempt 1 that failed with a plain 503, 10 s before the
// deadline: a retry, unless a test changes it.
func input() Input {
	return Input{
		Outcome: retry.Decision{Retry: true, Class: "status_503"},
		Attempt: 1, Now: t0, Deadline: t0.Add(10 * time.Second), Rand: half,
	}
}

func TestEachStopIsOneCase(t *testing.T) {
	tests := []struct {
		name   string
		change func(*Input)
		want   Result
	}{
		{"retry after half the 50 ms base", func(*Input) {}, Result{Wait: 25 * time.Millisecond}},
		{"not retryable", func(in *Input) { in.Outcome.Retry = false },
			Result{Stop: retry.ReasonNotRetryable}},
		{"the caller's cancellation, classified", func(in *Input) {
			in.Outcome = retry.Decision{Class: retry.ClassCanceled}
		}, Result{Stop: retry.ReasonCanceled}},
		{"the caller's deadline, classified", func(in *Input) {
			in.Outcome = retry.Decision{Class: retry.ClassCallerDeadline}
		}, Result{Stop: retry.ReasonCanceled}},
		{"canceled after a retryable outcome", func(in *Input) { in.Canceled = true },
			Result{Stop: retry.ReasonCanceled}},
		{"a marked answer", func(in *Input) { in.Marked = true }, Result{Stop: retry.ReasonRetriedBelow}},
		{"a marked answer that is not retryable", func(in *Input) {
			in.Marked, in.Outcome.Retry = true, false
		}, Result{Stop: retry.ReasonNotRetryable}},
		{"a marked answer at the last attempt", func(in *Input) { in.Marked, in.Attempt = true, 3 },
			Result{Stop: retry.ReasonRetriedBelow}},
		{"the last attempt", func(in *Input) { in.Attempt = 3 }, Result{Stop: retry.ReasonMaxAttempts}},
		{"a body that cannot be sent again", func(in *Input) { in.Body = retry.ReasonBodyNotRewindable },
			Result{Stop: retry.ReasonBodyNotRewindable}},
		{"Retry-After above the cap", func(in *Input) {
			in.Outcome.RetryAfter, in.Outcome.HasRetryAfter = 31*time.Second, true
		}, Result{Stop: retry.ReasonRetryAfterTooLong, Wait: 31 * time.Second}},
		{"Retry-After longer than the backoff", func(in *Input) {
			in.Outcome.RetryAfter, in.Outcome.HasRetryAfter = 2*time.Second, true
		}, Result{Wait: 2 * time.Second}},
		{"a wait that would end at the deadline", func(in *Input) { in.Deadline = t0.Add(25 * time.Millisecond) },
			Result{Stop: retry.ReasonDeadline, Wait: 25 * time.Millisecond}},
		{"a wait that ends just before it", func(in *Input) { in.Deadline = t0.Add(26 * time.Millisecond) },
			Result{Wait: 25 * time.Millisecond}},
		{"no deadline", func(in *Input) { in.Deadline = time.Time{} }, Result{Wait: 25 * time.Millisecond}},
		{"a throttled retry", func(in *Input) { in.Outcome.Throttle = true },
			Result{Wait: 500 * time.Millisecond, Throttle: true}},
		{"attempt 2 backs off twice as long", func(in *Input) { in.Attempt = 2 }, Result{Wait: 50 * time.Millisecond}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := input()
			tc.change(&in)
			assert.Equal(t, tc.want, Decide(cfg, in))
		})
	}
}

// Decide changes nothing: whatever it decides, it takes no budget (it is
// given none), and the caller's cancellation wins over the attempt limit.
func TestTheCallersCancellationWinsOverTheAttemptLimit(t *testing.T) {
	in := input()
	in.Canceled, in.Attempt = true, 3
	assert.Equal(t, retry.ReasonCanceled, Decide(cfg, in).Stop)
}

// Grant, the commit step, takes the retry's cost at its class, and a
// refusal takes nothing; a stop is returned as it is, and asks nothing.
func TestGrantTakesTheCostLast(t *testing.T) {
	b := budget.NewTokenBucket(budget.TokenBucketConfig{})
	r := Grant(b, t0, Decide(cfg, input()))
	assert.Equal(t, Result{Wait: 25 * time.Millisecond, Cost: 14}, r)
	assert.Equal(t, 486, b.Available(t0))

	in := input()
	in.Outcome.Throttle = true
	assert.Equal(t, Result{Wait: 500 * time.Millisecond, Throttle: true, Cost: 5}, Grant(b, t0, Decide(cfg, in)))
	assert.Equal(t, 481, b.Available(t0))

	small := budget.NewTokenBucket(budget.TokenBucketConfig{Capacity: 10})
	assert.Equal(t, Result{Stop: retry.ReasonBudget, Wait: 25 * time.Millisecond, BudgetLeft: 10},
		Grant(small, t0, Decide(cfg, input())))
	assert.Equal(t, 10, small.Available(t0), "a denial takes nothing")

	for name, change := range map[string]func(*Input){
		"not retryable":  func(in *Input) { in.Outcome.Retry = false },
		"canceled":       func(in *Input) { in.Canceled = true },
		"marked":         func(in *Input) { in.Marked = true },
		"max attempts":   func(in *Input) { in.Attempt = 3 },
		"body":           func(in *Input) { in.Body = retry.ReasonBodyNotRewindable },
		"Retry-After":    func(in *Input) { in.Outcome.RetryAfter, in.Outcome.HasRetryAfter = time.Hour, true },
		"no time to try": func(in *Input) { in.Deadline = t0 },
	} {
		t.Run(name, func(t *testing.T) {
			b := budget.NewTokenBucket(budget.TokenBucketConfig{})
			in := input()
			change(&in)
			stop := Decide(cfg, in)
			require.NotEmpty(t, stop.Stop)
			assert.Equal(t, stop, Grant(b, t0, stop))
			assert.Equal(t, 500, b.Available(t0), "nothing taken")
		})
	}
}

// The random value is drawn only when a wait is computed, so that a
// simulation's random stream does not depend on the stops before it.
func TestRandIsDrawnOnlyForAWait(t *testing.T) {
	draws := 0
	in := input()
	in.Rand = func() float64 { draws++; return 0.5 }
	in.Attempt = 3
	Decide(cfg, in)
	assert.Zero(t, draws)
	in.Attempt = 1
	Decide(cfg, in)
	assert.Equal(t, 1, draws)
	in.Rand = nil // math/rand/v2
	r := Decide(cfg, in)
	assert.Empty(t, r.Stop)
	assert.Less(t, r.Wait, 50*time.Millisecond)
}

func TestTheBackoffFormulaIsTheConfigs(t *testing.T) {
	c := cfg
	c.Backoff = jitter.Config{Func: jitter.None, Base: time.Second}
	in := input()
	in.Attempt = 2
	assert.Equal(t, Result{Wait: 2 * time.Second}, Decide(c, in))
}

// Only a success feeds the budget: it refunds a retry's cost, or adds the
// first-try reward; any other end records nothing.
func TestOnlyASuccessFeedsTheBudget(t *testing.T) {
	b := budget.NewTokenBucket(budget.TokenBucketConfig{})
	Begin(b, t0)
	cost, _ := b.AcquireRetry(t0, false)
	for _, status := range []int{0, 404, 422, 503} {
		End(b, t0, status, cost)
		assert.Equal(t, 486, b.Available(t0), "status %d", status)
	}
	End(b, t0, 200, cost)
	assert.Equal(t, 500, b.Available(t0), "the retry's cost refunded")
	b.AcquireRetry(t0, false)
	End(b, t0, 304, 0)
	assert.Equal(t, 487, b.Available(t0), "a first-try success adds 1")
}

func TestPushBack(t *testing.T) {
	for _, tc := range []struct {
		stop     retry.Reason
		attempts int
		status   int // 0: no answer
		marked   bool
		want     bool
	}{
		{retry.ReasonMaxAttempts, 3, 503, false, true},
		{retry.ReasonMaxAttempts, 3, 0, false, true},
		{retry.ReasonMaxAttempts, 3, 409, false, true},  // the in-progress conflict, retried
		{retry.ReasonMaxAttempts, 1, 503, false, false}, // nothing was retried: the layer above may
		{retry.ReasonMaxAttempts, 1, 503, true, true},
		{retry.ReasonBudget, 1, 503, false, true},
		{retry.ReasonDeadline, 1, 0, false, true},
		{retry.ReasonRetryAfterTooLong, 1, 429, false, true},
		{retry.ReasonRetriedBelow, 1, 503, true, true},
		{retry.ReasonRetriedBelow, 2, 429, true, true},
		{retry.ReasonNotRetryable, 1, 500, false, false},
		{retry.ReasonNotRetryable, 1, 500, true, true},
		{retry.ReasonNotRetryable, 1, 404, true, false}, // the mark on a 404 is no mark
		{retry.ReasonNotRetryable, 1, 200, true, false},
		// Retried, then stopped on something else: pushed back unless the
		// last answer is below 500 but 429.
		{retry.ReasonNotRetryable, 3, 500, false, true},
		{retry.ReasonNotRetryable, 2, 429, false, true},
		{retry.ReasonNotRetryable, 2, 0, false, true},
		{retry.ReasonNotRetryable, 2, 404, false, false},
		{retry.ReasonNotRetryable, 2, 200, false, false},
		{retry.ReasonCanceled, 1, 0, false, false},
		{retry.ReasonCanceled, 2, 0, false, true},
		{retry.ReasonBodyNotRewindable, 1, 503, false, false},
		{retry.ReasonBodyNotRewindable, 2, 503, false, true},
		{retry.ReasonPrepare, 0, 0, false, false},
		{retry.ReasonPrepare, 2, 0, false, true},
	} {
		assert.Equal(t, tc.want, PushBack(tc.stop, tc.attempts, tc.status, tc.marked), "%+v", tc)
	}
}

func TestHedge(t *testing.T) {
	in := HedgeInput{Sent: 1, InFlight: 1, Now: t0, Deadline: t0.Add(time.Second)}
	assert.True(t, Hedge(3, 1, in), "one attempt in flight, two left")
	for name, change := range map[string]func(*HedgeInput){
		"stopped (pushback, Retry-After, budget)": func(in *HedgeInput) { in.Stopped = true },
		"canceled":                      func(in *HedgeInput) { in.Canceled = true },
		"no attempt left":               func(in *HedgeInput) { in.Sent = 3 },
		"the hedges in flight are many": func(in *HedgeInput) { in.Sent, in.InFlight = 2, 2 },
		"nothing in flight":             func(in *HedgeInput) { in.InFlight = 0 },
		"the deadline passed":           func(in *HedgeInput) { in.Now = in.Deadline },
	} {
		c := in
		change(&c)
		assert.False(t, Hedge(3, 1, c), name)
	}
	more := in
	more.Sent, more.InFlight = 2, 2
	assert.True(t, Hedge(3, 2, more), "two hedges in flight at once")
	more.Deadline = time.Time{}
	assert.True(t, Hedge(3, 2, more), "no deadline")
}
