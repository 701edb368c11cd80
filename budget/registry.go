package budget

import (
	"strings"
	"sync"
)

// DefaultMaxHosts is the number of hosts a [Registry] gives a budget of their
// own unless [MaxHosts] says otherwise.
const DefaultMaxHosts = 4096

// RegistryOption configures [NewRegistry].
type RegistryOption func(*Registry)

// MaxHosts bounds the hosts that get a budget of their own; n <= 0 means
// [DefaultMaxHosts]. Hosts seen after the bound is reached all share one
// overflow budget, so memory stays bounded however many hosts a process calls
// (a crawler, say), and a drained budget is never silently reset by eviction.
// Sharing errs on the safe side: fewer retries, never more.
func MaxHosts(n int) RegistryOption {
	return func(r *Registry) {
		if n <= 0 {
			n = DefaultMaxHosts
		}
		r.max = n
	}
}

// Registry hands out one [Budget] per host, created lazily by the function
// given to [NewRegistry] on the first For call for that host, so that one
// outage of one host does not stop retries to others while every Transport
// using the registry shares each host's budget. It holds at most MaxHosts
// budgets (default [DefaultMaxHosts]) plus one overflow budget and never
// forgets a host. A Registry is safe for concurrent use; it starts no
// goroutines. Create it with [NewRegistry]; the zero value is not usable.
type Registry struct {
	newBudget func() Budget
	max       int

	// known holds every host's budget, read without a lock; mu serialises
	// creation and guards hosts (how many there are) and overflow.
	known    sync.Map // string -> Budget
	mu       sync.Mutex
	hosts    int
	overflow Budget
}

// NewRegistry returns an empty registry whose budgets newBudget creates; nil
// (or a newBudget that returns nil) means NewTokenBucket(TokenBucketConfig{}),
// the default token bucket. newBudget is called under the registry's lock,
// once per host, and must not call the registry. Options: [MaxHosts].
func NewRegistry(newBudget func() Budget, opts ...RegistryOption) *Registry {
	r := &Registry{newBudget: newBudget, max: DefaultMaxHosts}
	for _, o := range opts {
		if o != nil {
			o(r)
		}
	}
	return r
}

// For returns the budget of host, creating it on first use. host is
// compared case-insensitively and otherwise as given: callers pass the
// request URL's Host (host or host:port), so "example.com" and
// "example.com:443" are different hosts. Past MaxHosts distinct hosts, new
// hosts get the shared overflow budget. Safe for concurrent use; never nil.
func (r *Registry) For(host string) Budget {
	host = strings.ToLower(host) // no allocation when already lower case
	if b, ok := r.known.Load(host); ok {
		return b.(Budget)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if b, ok := r.known.Load(host); ok { // created while we waited
		return b.(Budget)
	}
	if r.hosts >= r.max {
		if r.overflow == nil {
			r.overflow = r.create()
		}
		return r.overflow
	}
	b := r.create()
	r.known.Store(host, b)
	r.hosts++
	return b
}

// Len returns how many hosts have a budget of their own (the overflow
// budget not included). Safe for concurrent use.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hosts
}

func (r *Registry) create() Budget {
	if r.newBudget != nil {
		if b := r.newBudget(); b != nil {
			return b
		}
	}
	return NewTokenBucket(TokenBucketConfig{})
}

var defaultRegistry = sync.OnceValue(func() *Registry { return NewRegistry(nil) })

// Default returns the process-wide registry of default token buckets (see
// [NewTokenBucket]), one per host up to [DefaultMaxHosts], created lazily.
// It is what a Transport uses unless told otherwise, so every Transport in
// the process shares each host's budget. Safe for concurrent use; always
// the same *Registry.
func Default() *Registry { return defaultRegistry() }
