// Package budget is the fleet retry budget of saferetry: it decides whether
// a client may retry at all, so that an outage is not made worse by its own
// clients' retries.
//
// Per-request limits (3 attempts, backoff) are not enough: a fleet whose
// every instance retries "reasonably" still sends up to 3x the load to a
// server that is failing, exactly when it can least take it. A budget caps
// retries as a share of traffic instead. The client Transport asks its
// [Budget] before every retry (never before attempt 1), reports successes,
// and when denied returns the last outcome instead of retrying.
//
// # Token bucket (the default)
//
// [TokenBucket] implements the retry quota of the AWS SDKs' retry behaviour
// 2.1, refilled with time as well: a bucket of 500 tokens, starting full; a
// retry after a transient failure costs 14 tokens, a retry after throttling
// (429, or 503 asking for a wait) costs 5; a retry that succeeds refunds its
// cost; a first-try success adds 1; time adds 500 tokens a minute; never
// above 500; a retry whose cost exceeds what is left is denied and takes
// nothing. During a full outage the bucket drains after 35 transient
// retries, and then time alone pays for one transient retry every 1.68 s
// per host and process, so amplification tends to 1 for a client with
// traffic (1.047 in examples/fleetsim's fleet of 20 processes at 50
// requests a second, against 1.035 without the refill). For a client with
// much traffic, the quota keeps draining once roughly 22% or more of first
// attempts fail for a sustained period (each failure's retry costs 14,
// funded by first-try successes at 1 each; time's 8 tokens a second add
// little there).
//
// With no traffic at all, a drained bucket is full again within a minute
// (RefillTime), and a transient retry is affordable again within 1.7 s.
// Without the refill (RefillTime negative: the AWS SDKs' bucket), only
// successes refill it: about 490 first-try successes, 8 minutes at one
// request a second, before the bucket is full again. The minute is the
// trade between the two failures a budget stands between: a shorter
// RefillTime brings retries back sooner but pays for more of them in a
// long outage (10 s gives that fleet 1.108), a longer one makes a quiet
// client wait longer for its first retry (5 minutes: 8.4 s). The refill's
// rate does not grow with traffic, so it matters most to a process that
// sends a host few requests: in a full outage, at q requests a second, it
// adds at most about 0.6/q retries per request (0.6 at one a second); a
// fleet of many such processes that must stay near 1 sets RefillTime
// negative or longer.
//
// # Ratio
//
// [Ratio] allows retries up to a share of logical requests (default 20%)
// in a sliding window (default 10 s, ten 1 s sub-buckets), plus a small floor
// (default 10 retries per second, a golang.org/x/time/rate limiter) so that a
// client with little traffic can still retry. Its doc comment states the
// guarantee precisely: the retries of any period are at most 20% of the
// requests of that period and of the window before it, plus the floor, and
// over the life of the budget at most 20% of all requests plus the floor.
// Proportional budgets compose: if every instance caps its retries at 20% of
// its own logical requests, the whole fleet's retries are at most 20% of the
// fleet's requests, so the load reaching the server is at most 1.2x the
// logical load, without any coordination or shared store.
// The floor does not compose that way (it adds FloorPerSecond per instance),
// which is why it is small.
//
// # Registry
//
// Budgets are per host: one outage of one host must not stop retries to
// others. A [Registry] creates one budget per host lazily. Every saferetry
// Transport shares one process-wide registry of default token buckets
// unless its WithBudget option gives it another Budget: a Registry of its
// own (per host), or one budget for all its hosts. [Unlimited] exists for
// tests and batch jobs.
//
// All types are safe for concurrent use, start no goroutines and take the
// current time as a parameter, so tests and simulations drive the clock.
package budget
