package budget

import (
	"time"

	"github.com/saferetry/saferetry/internal/hosts"
	"github.com/saferetry/saferetry/internal/nilcheck"
)

// Registry hands out one [Budget] per host, created on the first For call
// for that host by the function given to [NewRegistry], so that an outage
// of one host does not stop retries to others while every user of the
// registry shares each host's budget. The saferetry Transport asks a
// Registry given to its WithBudget option for each request's host (the
// default is a process-wide registry of default token buckets).
//
// It holds at most 4096 hosts' budgets and never forgets a host: the hosts
// seen after that share one overflow budget, so memory stays bounded however
// many hosts a process calls (a crawler, say), and sharing errs on the safe
// side (fewer retries, never more).
//
// A Registry is itself a Budget, so that the Transport's WithBudget option
// takes it: used without a host, its Budget methods act on the budget of
// the empty host "". The Transport finds its For method instead, as it does
// on any Budget that has one. A Registry is safe for concurrent use and
// starts no goroutines. Create it with [NewRegistry]; the zero value is not
// usable.
type Registry struct {
	newBudget func() Budget
	hosts     hosts.Map[Budget] // at most hosts.Max (4096) of their own
}

var _ Budget = (*Registry)(nil)

// NewRegistry returns an empty registry whose budgets newBudget creates; nil
// (or a newBudget that returns nil, or a typed nil such as a nil
// *TokenBucket) means NewTokenBucket(TokenBucketConfig{}), the default token
// bucket. newBudget is called under the registry's lock,
// once per host, and must not call the registry.
func NewRegistry(newBudget func() Budget) *Registry {
	r := &Registry{newBudget: newBudget}
	r.hosts.New = r.create
	return r
}

// For returns the budget of host, creating it on first use. host is
// compared case-insensitively and otherwise as given: the Transport passes
// the request URL's Host (host or host:port), so "example.com" and
// "example.com:443" are different hosts. Safe for concurrent use; never nil.
func (r *Registry) For(host string) Budget { return r.hosts.For(host) }

func (r *Registry) create() Budget {
	if r.newBudget != nil {
		if b := r.newBudget(); !nilcheck.Is(b) {
			return b
		}
	}
	return NewTokenBucket(TokenBucketConfig{})
}

// OnRequest calls OnRequest on the budget of the host "".
func (r *Registry) OnRequest(now time.Time) { r.For("").OnRequest(now) }

// AcquireRetry calls AcquireRetry on the budget of the host "".
func (r *Registry) AcquireRetry(now time.Time, throttled bool) (int, bool) {
	return r.For("").AcquireRetry(now, throttled)
}

// Refund calls Refund on the budget of the host "".
func (r *Registry) Refund(now time.Time, cost int) { r.For("").Refund(now, cost) }

// OnSuccess calls OnSuccess on the budget of the host "".
func (r *Registry) OnSuccess(now time.Time, retryCost int) { r.For("").OnSuccess(now, retryCost) }

// Available calls Available on the budget of the host "".
func (r *Registry) Available(now time.Time) int { return r.For("").Available(now) }
