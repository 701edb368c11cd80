package saferetry

import (
	"log/slog"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// Defaults of a Transport built with no options. Each has an Option.
const (
	// DefaultMaxAttempts is the number of attempts in total, first one
	// included (the AWS SDKs' standard mode).
	DefaultMaxAttempts = 3
	// DefaultMaxElapsed bounds the whole retry loop: attempts and sleeps.
	DefaultMaxElapsed = 30 * time.Second
	// DefaultRetryAfterCap is the longest Retry-After the Transport sleeps;
	// a longer one ends the loop and the response is returned at once.
	DefaultRetryAfterCap = 30 * time.Second
	// DefaultBodyBufferLimit is the largest request body without GetBody
	// that is buffered to make it retryable.
	DefaultBodyBufferLimit = 1 << 20
	// DefaultKeyHeader is the idempotency key header.
	DefaultKeyHeader = "Idempotency-Key"
	// drainLimit bounds how much of a discarded response body is read so
	// that its connection can be reused.
	drainLimit = 64 << 10
)

// Option configures a Transport. Options are applied in order; a later one
// wins. Invalid values (a negative duration, zero attempts) are ignored and
// the default stays, so an Option never makes a Transport unusable.
type Option func(*config)

type config struct {
	maxAttempts     int
	backoff         jitter.Config
	maxElapsed      time.Duration
	attemptTimeout  time.Duration
	retryAfterCap   time.Duration
	logger          *slog.Logger
	retry500        bool
	bodyBufferLimit int64
	budget          budget.Budget
	registry        *budget.Registry
	autoKeys        bool
	keyHeader       string
	deadlineHeader  deadlineMode
	rules           []retry.Rule
	prepare         []PrepareFunc
	observers       []Observer
}

// deadlineMode says when a request carries deadline.Header.
type deadlineMode int8

const (
	deadlineIfContext deadlineMode = iota // the default: when the context has a deadline
	deadlineAlways                        // WithDeadlineHeader(true)
	deadlineNever                         // WithDeadlineHeader(false)
)

func defaultConfig() config {
	return config{
		maxAttempts:     DefaultMaxAttempts,
		maxElapsed:      DefaultMaxElapsed,
		retryAfterCap:   DefaultRetryAfterCap,
		bodyBufferLimit: DefaultBodyBufferLimit,
		autoKeys:        true,
		keyHeader:       DefaultKeyHeader,
	}
}

// WithMaxAttempts sets the number of attempts in total, the first included
// (default 3). 1 disables retries. Values below 1 are ignored.
func WithMaxAttempts(n int) Option {
	return func(c *config) {
		if n >= 1 {
			c.maxAttempts = n
		}
	}
}

// WithBackoff sets the backoff formula and its bases and cap. Zero fields of
// cfg mean the jitter package's defaults: full jitter, base 50 ms for
// transient failures, 1 s for throttling (429, or 503 with Retry-After),
// cap 20 s.
func WithBackoff(cfg jitter.Config) Option {
	return func(c *config) { c.backoff = cfg }
}

// WithMaxElapsed bounds the whole retry loop (default 30 s): the overall
// deadline is the earlier of the request context's deadline and the start
// plus d. No attempt starts and no sleep begins that would end after it.
// The server is told of d only with WithDeadlineHeader(true): by default the
// deadline header carries the caller's own deadline alone. Values of 0 or
// less are ignored.
func WithMaxElapsed(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.maxElapsed = d
		}
	}
}

// WithAttemptTimeout bounds each attempt until its response headers arrive
// (default off: only the overall deadline applies). An attempt that times out
// is retried when the request is idempotent or carries a key. A good value is
// 2 to 3 times the measured p99 latency of the endpoint. The timeout never
// extends past the overall deadline; it does not cut the reading of the
// returned response's body, which the caller's context governs. 0 turns it
// off; negative values are ignored.
func WithAttemptTimeout(d time.Duration) Option {
	return func(c *config) {
		if d >= 0 {
			c.attemptTimeout = d
		}
	}
}

// WithRetryAfterCap sets the longest server-sent Retry-After the Transport
// honours by sleeping (default 30 s). A longer one, or one that would end
// after the overall deadline, ends the loop and returns that response at once.
// Values of 0 or less are ignored.
func WithRetryAfterCap(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.retryAfterCap = d
		}
	}
}

// WithLogger sets the logger that receives one record per attempt (default
// slog.Default(), looked up at each record). Debug: a first-try final
// outcome; Info: an attempt that will be retried, or a final outcome after
// retries; Warn: giving up while the outcome was still a retryable failure.
// The records are written by the Transport's logging Observer, which runs
// before those of WithObserver. A nil logger is ignored.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) {
		if l != nil {
			c.logger = l
		}
	}
}

// WithRetry500 opts in to retrying 500 Internal Server Error (default off:
// a 500 usually means a bug, and a bug does not go away on retry). It only
// applies to requests that are idempotent or carry a key.
func WithRetry500() Option {
	return func(c *config) { c.retry500 = true }
}

// WithBodyBufferLimit sets how many bytes of a request body without GetBody
// are buffered to make it retryable (default 1 MiB). A larger body is sent
// once and not retried, and that is logged. Negative values are ignored; 0
// means such bodies are never buffered.
func WithBodyBufferLimit(n int64) Option {
	return func(c *config) {
		if n >= 0 {
			c.bodyBufferLimit = n
		}
	}
}

// WithBudget makes every request of this Transport draw its retries from b,
// instead of the process-wide per-host registry (budget.Default()). Use
// budget.Unlimited() for tests and batch jobs. A nil b is ignored.
func WithBudget(b budget.Budget) Option {
	return func(c *config) {
		if b != nil {
			c.budget, c.registry = b, nil
		}
	}
}

// WithBudgetRegistry makes this Transport draw retries from r.For(host) for
// each request's host (default budget.Default(), shared by every Transport in
// the process). A nil r is ignored.
func WithBudgetRegistry(r *budget.Registry) Option {
	return func(c *config) {
		if r != nil {
			c.registry, c.budget = r, nil
		}
	}
}

// WithAutoKeys turns the automatic idempotency key on or off (default on).
// When on, a POST or PATCH request without a key gets one before its first
// attempt: the key of keygen.FromContext(ctx) when the context carries one,
// otherwise keygen.Random(). Every attempt of that request reuses it, and
// because the key lets the server de-duplicate them, such requests are
// retried on every allow-listed outcome. Keep it on only for servers that
// honour Idempotency-Key; with it off, a POST or PATCH without a key is
// retried only when it provably never left.
func WithAutoKeys(on bool) Option {
	return func(c *config) { c.autoKeys = on }
}

// WithKeyHeader sets the name of the idempotency key header (default
// "Idempotency-Key"). An empty name is ignored.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		if name != "" {
			c.keyHeader = name
		}
	}
}

// WithDeadlineHeader sets when each attempt tells the server how long the
// client still waits, in the deadline.Header header (Request-Deadline-Ms,
// whole milliseconds before the overall deadline, recomputed per attempt),
// which deadline.Middleware turns back into a context deadline on the server.
//
// By default (this option not given) the header is sent only when the
// request's context has a deadline, as gRPC sends grpc-timeout: the value is
// the time left before the earlier of that deadline and the start plus
// MaxElapsed. The Transport's own MaxElapsed alone still bounds the retry
// loop, but is not advertised. WithDeadlineHeader(true) sends the header on
// every request, a context without a deadline included (the value then comes
// from MaxElapsed); WithDeadlineHeader(false) never sends it.
func WithDeadlineHeader(on bool) Option {
	return func(c *config) {
		c.deadlineHeader = deadlineNever
		if on {
			c.deadlineHeader = deadlineAlways
		}
	}
}

// WithRetryPolicy adds rules that widen or narrow the retry allow-list per
// outcome: status, error, request, attempt number (default none). For
// example retry.OnRequest(onHostA, retry.Status(retry.Allow, 500)) retries
// 500 on one host, retry.Status(retry.Deny, 503) never retries 503. Rules
// run in order, those of earlier WithRetryPolicy options first, after the
// built-in decision; the first verdict other than retry.Keep decides.
//
// No rule lifts the safety rules, which are applied after the rules: a
// success (a status below 400) is never retried; an unsafe request without
// a key (a POST with WithAutoKeys(false), a request marked NotIdempotent)
// is never sent again once it may have reached the server (after a status,
// a reset or a timeout), only when it provably never left; the caller's cancellation and deadline end the loop; the attempt
// limit, the overall deadline, the Retry-After cap and the retry budget are
// still checked before every retry. See retry.Classify. Nil rules are
// ignored.
func WithRetryPolicy(rules ...retry.Rule) Option {
	return func(c *config) {
		for _, r := range rules {
			if r != nil {
				c.rules = append(c.rules, r)
			}
		}
	}
}

// WithPrepare adds f to the functions that prepare each attempt's request
// just before it is sent (default none): see PrepareFunc. Several run in the
// order of their options. When one is set, each attempt gets its own header
// map and URL. A nil f is ignored.
func WithPrepare(f PrepareFunc) Option {
	return func(c *config) {
		if f != nil {
			c.prepare = append(c.prepare, f)
		}
	}
}

// WithObserver adds o to the Transport's observers (default: only the
// logging observer of WithLogger). Every observer sees every attempt and
// call, in the order of their options, after the logging observer. An
// Observer with no function set is ignored.
func WithObserver(o Observer) Option {
	return func(c *config) {
		if o.AttemptStart != nil || o.AttemptDone != nil || o.CallDone != nil {
			c.observers = append(c.observers, o)
		}
	}
}
