package saferetry

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/retry"
)

// Defaults of a Transport built with no options, stated for users in the
// package documentation.
const (
	defaultMaxBufferedBody = 1 << 20
	defaultKeyHeader       = "Idempotency-Key"
	// maxDrain bounds how much of a discarded response body is read so that
	// its connection can be reused.
	maxDrain = 64 << 10
)

// Option configures a Transport: one option per setting, applied in order,
// a later one winning. Each option's documentation says what every value
// means, the out-of-range ones included; no value is silently replaced by a
// default.
type Option func(*config)

type config struct {
	maxAttempts     int
	backoff         jitter.Config
	maxElapsed      time.Duration // 0: no bound of the Transport's own
	attemptTimeout  time.Duration // 0: none
	maxRetryAfter   time.Duration
	logger          *slog.Logger // nil: slog.Default(), unless noLog
	noLog           bool
	maxBufferedBody int64
	budget          budget.Budget
	autoKeys        bool
	keyHeader       string
	deadlineHeader  deadlineMode
	attemptHeader   bool
	rules           []retry.Rule
	prepare         []func(*http.Request, int) error
	observers       []Observer
	hedging         bool // WithHedging was given
	hedge           Hedging
	followAccepted  bool // WithFollowAccepted
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
		maxAttempts:     decide.DefaultMaxAttempts,
		maxElapsed:      decide.DefaultMaxElapsed,
		maxRetryAfter:   decide.DefaultMaxRetryAfter,
		maxBufferedBody: defaultMaxBufferedBody,
		autoKeys:        true,
		keyHeader:       defaultKeyHeader,
		attemptHeader:   true,
	}
}

// WithMaxAttempts sets the number of attempts in all, the first included
// (default 3), hedges (WithHedging), retries and the base transport's own
// re-sends together. 1, and any value below 1, means a single attempt: no
// retries, no hedges. A re-send of the base transport's, which nothing can
// refuse, is counted even past the limit (see the package documentation).
func WithMaxAttempts(n int) Option {
	return func(c *config) { c.maxAttempts = max(1, n) }
}

// WithBackoff sets the wait before each retry (default full jitter, base
// 50 ms for transient failures and 1 s for throttling, cap 20 s). Zero
// fields of cfg mean those defaults (see jitter.Config). A server's
// Retry-After, when longer, wins.
func WithBackoff(cfg jitter.Config) Option {
	return func(c *config) { c.backoff = cfg }
}

// WithMaxElapsed bounds the whole retry loop, attempts and waits (default
// 30 s): the overall deadline is the earlier of the request context's
// deadline and the start plus d. No attempt outlives it and no wait starts
// that would end after it. d <= 0 means no bound of the Transport's own:
// the context's deadline alone, if any, and WithAttemptTimeout bound the
// loop.
func WithMaxElapsed(d time.Duration) Option {
	return func(c *config) { c.maxElapsed = max(0, d) }
}

// WithAttemptTimeout bounds each attempt (default none: the overall
// deadline alone): from its start until its response is handed over, which
// covers the wait for the headers and everything the Transport then does
// with the response, never the caller's reading of the returned body. It
// never extends past the overall deadline. An attempt that times out is
// retried when the request may be repeated. A good value is 2 to 3 times
// the endpoint's measured p99 latency. d <= 0 means none.
func WithAttemptTimeout(d time.Duration) Option {
	return func(c *config) { c.attemptTimeout = max(0, d) }
}

// WithMaxRetryAfter sets the longest Retry-After the Transport honours by
// waiting (default 30 s). A longer one ends the loop (stop reason
// retry.ReasonRetryAfterTooLong), as does one that would end after the
// overall deadline (retry.ReasonDeadline), and the response is returned at
// once. d <= 0 means that any positive Retry-After ends the loop.
func WithMaxRetryAfter(d time.Duration) Option {
	return func(c *config) { c.maxRetryAfter = max(0, d) }
}

// WithLogger sets the logger of the one record written per attempt
// (default slog.Default(), looked up at each record); nil turns logging
// off. Debug: a first-try answer below 500, an attempt that lost to a
// hedge; Info: an attempt that will be retried, one discarded while another
// was in flight, or an answer after retries or a 5xx; Warn: an error, or
// the loop stopped while the outcome could have been retried. A hedge's
// record has hedge=true. The records
// never carry the raw key, only its digest. They are written by an
// Observer that runs before those of WithObserver.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger, c.noLog = l, l == nil }
}

// WithMaxBufferedBody sets how many bytes of a request body without GetBody
// are buffered to make it replayable (default 1 MiB). A larger body is sent
// once, as a stream, and not retried, which is logged. n <= 0 means that no
// body without GetBody is buffered, so none is retried.
func WithMaxBufferedBody(n int64) Option {
	return func(c *config) { c.maxBufferedBody = max(0, n) }
}

// WithBudget sets the retry budget this Transport asks before every retry
// (default: a process-wide budget.Registry of default token buckets, one
// per host, shared by every Transport). A Budget that also has a method
// For(host string) budget.Budget, as *budget.Registry has (and a wrapper
// around one that forwards For), gives each request the budget For returns
// for its URL's Host (nil from For means the default budget of that host);
// any other Budget is shared by every host of this Transport.
// budget.Unlimited() grants every retry: for tests and batch jobs only. nil,
// and a typed nil such as a nil *budget.TokenBucket, mean the default.
func WithBudget(b budget.Budget) Option {
	return func(c *config) { c.budget = b }
}

// WithAutoKeys turns the automatic idempotency key on or off (default on).
// When on, a POST or PATCH without a key gets one before its first attempt:
// the key of keygen.FromContext(ctx) when the context carries one,
// otherwise keygen.Random(). Every attempt reuses it, and because the key
// lets the server de-duplicate them, such requests are retried on every
// allow-listed outcome. Keep it on only for servers that honour
// Idempotency-Key; with it off, a POST or PATCH without a key is retried
// only when it provably never left.
func WithAutoKeys(on bool) Option {
	return func(c *config) { c.autoKeys = on }
}

// WithKeyHeader sets the name of the idempotency key header (default
// "Idempotency-Key"). "" means the default name. A name that is not an
// HTTP field name (a token: letters, digits and !#$%&'*+-.^_`|~), or that
// is, in any case, one of the headers the Transport sets itself
// (Request-Attempt, Request-Deadline-Ms), which would overwrite the key on
// every attempt, or a field that never reaches the server as sent (Host,
// Content-Length, Transfer-Encoding, Trailer and Expect, which net/http
// writes itself; the hop-by-hop Connection, Keep-Alive, Proxy-Connection,
// TE and Upgrade), which would leave the server without the key, is
// refused: every RoundTrip of the Transport then fails before any I/O with
// an error that matches ErrInvalidKeyHeader.
func WithKeyHeader(name string) Option {
	return func(c *config) {
		c.keyHeader = name
		if name == "" {
			c.keyHeader = defaultKeyHeader
		}
	}
}

// WithDeadlineHeader sets when each attempt tells the server how long the
// client still waits, in the deadline.Header header (Request-Deadline-Ms:
// whole milliseconds left before the overall deadline, per attempt), which
// deadline.Middleware turns back into a context deadline.
//
// By default the header goes only with a request whose context has a
// deadline, as gRPC sends grpc-timeout; WithMaxElapsed alone bounds the
// loop but is not advertised. true sends it on every request that has an
// overall deadline (from WithMaxElapsed when the context has none); false
// never sends it. When sent, it replaces any value the caller set, under
// any spelling of the name; when not, the caller's goes as it is.
func WithDeadlineHeader(on bool) Option {
	return func(c *config) {
		c.deadlineHeader = deadlineNever
		if on {
			c.deadlineHeader = deadlineAlways
		}
	}
}

// WithAttemptHeader sets whether each attempt tells the server its number
// (default on): "Request-Attempt: 1" on the first attempt, 2 on the first
// retry, and so on, replacing any value the caller set, under any spelling
// of the name (req.Header["request-attempt"] too). deadline.Middleware
// reads it (deadline.Attempt), so that a server can tell first tries from
// retries in its load; docs/CONTRACT.md gives the syntax. false sends no
// attempt header and leaves the caller's, if any, as it is.
func WithAttemptHeader(on bool) Option {
	return func(c *config) { c.attemptHeader = on }
}

// WithRetryPolicy adds rules that widen or narrow the allow-list per
// outcome (default none): for example retry.Status(retry.Allow, 500)
// retries 500, retry.Status(retry.Deny, 503) never retries 503. Rules run
// in order, those of earlier options first; the first verdict other than
// retry.Keep decides. No rule lifts the safety rules of the package
// documentation, nor the attempt limit, the deadline, the budget or an
// answer marked "Retried-Below: true". Nil rules are skipped.
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
// just before it is sent (default none); several run in the order of their
// options. f runs after the body is rewound, after the AttemptStart
// observers (r.Context() is the attempt's context) and after the deadline
// and attempt headers are set; attempt is 1 for the first attempt. Use it to sign each
// attempt (AWS SigV4, an HMAC of a webhook) or to set a fresh token.
//
// r is the attempt's own copy: f may change r.Header (its own map and value
// slices) and r.URL (its own copy, for example a presigned query), never
// the caller's request. It must not read or replace r.Body; to hash the
// payload, it reads a fresh copy from r.GetBody, set whenever the body can
// be replayed. It must not change the idempotency key header: that fails
// the attempt with ErrKeyChanged, since a signature over a key the
// Transport put back would be wrong.
//
// f does not run again for a re-send that net/http makes of a bodyless
// attempt by itself (see the package documentation): the re-send goes as f
// prepared it, with a Request-Attempt and a Request-Deadline-Ms of its own,
// so leave those two fields out of a signature.
//
// An error from f, or ErrKeyChanged, ends the loop before the attempt is
// sent: RoundTrip returns a *retry.ExhaustedError with Reason
// retry.ReasonPrepare, Attempts the attempts sent before, and an Err that
// wraps f's error. When an earlier attempt may have reached the server, its
// outcome is unknown: send the request again later with the same key
// (ExhaustedError.Key). f may be called concurrently for different
// requests; a panic in it is not recovered. A nil f is skipped.
func WithPrepare(f func(r *http.Request, attempt int) error) Option {
	return func(c *config) {
		if f != nil {
			c.prepare = append(c.prepare, f)
		}
	}
}

// WithObserver adds o to the Transport's observers (default: only the
// logging observer of WithLogger). Every observer sees every attempt and
// call, in the order of their options, after the logging observer. An
// Observer with no function set is skipped.
func WithObserver(o Observer) Option {
	return func(c *config) {
		if o.AttemptStart != nil || o.AttemptDone != nil || o.CallDone != nil || o.Poll != nil {
			c.observers = append(c.observers, o)
		}
	}
}

// WithHedging turns hedged requests on (default off): when the attempts in
// flight have had no response headers for h.Delay (0: adaptive, the host's
// recent p95), the Transport sends one more beside them, a hedge, up to
// h.MaxHedges at once (0: 1; below 0: hedging off). The first final answer
// (one the loop would not retry) wins and is returned; the attempts still
// in flight lose and are canceled, never the winner, whose context lives
// until its body is closed, and RoundTrip returns once each loser has
// ended (a base transport that honours the request's context, as
// net/http's does, ends it at once). A panic of the base transport in a
// hedge, a loser's included, is raised again on the goroutine of
// RoundTrip, as it would be without hedging. A retryable answer (a 503, the in-progress 409
// a hedged POST's loser gets) or an error while another attempt is in
// flight is set aside, and the Transport waits for the others: the caller
// gets an answer a hedge did not make worse.
//
// Only a request that may be sent again whatever its outcome is hedged (see
// the package documentation): a POST or PATCH only with an idempotency key,
// which every hedge carries, so that the server's idempotency middleware
// answers all but one with the in-progress conflict or the replay, and no
// effect is duplicated. Its body must be replayable. Hedges are attempts:
// they count in WithMaxAttempts with the retries, each carries its own
// Request-Attempt number, the observers and the logs see each (with
// AttemptStartInfo.Hedge), and one overall deadline bounds them all. Each
// hedge asks the host's retry budget, at the cost of a transient retry: a
// denial stops the call's hedging and never ends an attempt in flight, and
// a hedge that wins with a success gets its cost back, as a retried
// success does. No hedge follows an answer marked "Retried-Below: true" or
// one with a Retry-After, in the whole call.
func WithHedging(h Hedging) Option {
	return func(c *config) { c.hedging, c.hedge = true, h }
}

// ErrInvalidKeyHeader is matched by the error of every RoundTrip of a
// Transport whose WithKeyHeader name is refused: not an HTTP field name,
// the name of one of the Transport's own headers, or of a field that never
// reaches the server as sent.
var ErrInvalidKeyHeader = errors.New("saferetry: invalid key header name")

// notEndToEnd are the request fields that never reach the server as the
// caller wrote them: net/http writes Host, Content-Length,
// Transfer-Encoding, Trailer and Expect from the request itself, and the
// others are hop-by-hop (RFC 9110 section 7.6.1), which HTTP/2 refuses and
// proxies drop.
var notEndToEnd = []string{"Host", "Content-Length", "Transfer-Encoding", "Trailer", "Expect",
	"Connection", "Keep-Alive", "Proxy-Connection", "TE", "Upgrade"}

// checkKeyHeader returns why name cannot be the key header, nil when it can.
func checkKeyHeader(name string) error {
	for _, own := range []string{hop.AttemptHeader, deadline.Header} {
		if strings.EqualFold(name, own) {
			return fmt.Errorf("%w: WithKeyHeader(%q): the Transport sets %s itself",
				ErrInvalidKeyHeader, name, own)
		}
	}
	for _, f := range notEndToEnd {
		if strings.EqualFold(name, f) {
			return fmt.Errorf("%w: WithKeyHeader(%q): %s never reaches the server as sent",
				ErrInvalidKeyHeader, name, f)
		}
	}
	for i := 0; i < len(name); i++ {
		if !tokenChar(name[i]) {
			return fmt.Errorf("%w: WithKeyHeader(%q): byte %d is not a token character",
				ErrInvalidKeyHeader, name, i)
		}
	}
	return nil
}

// tokenChar reports whether c may appear in an HTTP field name (RFC 9110
// section 5.6.2, tchar).
func tokenChar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
