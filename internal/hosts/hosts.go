// Package hosts is a map from a host to a value of its own, created on
// first use, with a bound on the hosts it holds: budget.Registry keeps a
// retry budget per host in one, the saferetry Transport the latency
// estimate of its adaptive hedge delay.
package hosts

import (
	"strings"
	"sync"
)

// Max is how many hosts a Map gives a value of their own unless its Limit
// says otherwise.
const Max = 4096

// Map holds one V per host, which New creates on the host's first use.
// Hosts compare case-insensitively and otherwise as given. It never forgets
// a host; past Limit hosts (0 means Max), the others share one more V, so
// that memory stays bounded however many hosts a process calls. Safe for
// concurrent use once New and Limit are set; starts no goroutines.
type Map[V any] struct {
	New   func() V // called under the map's lock, once per value; must not call the map
	Limit int

	// known holds every host's value, read without a lock; mu serialises
	// creation and guards n (how many hosts known holds) and overflow.
	known    sync.Map // string -> V
	mu       sync.Mutex
	n        int
	overflow *V
}

// For returns the value of host, creating it on first use.
func (m *Map[V]) For(host string) V {
	host = strings.ToLower(host) // no allocation when already lower case
	if v, ok := m.known.Load(host); ok {
		return v.(V)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if v, ok := m.known.Load(host); ok { // created while we waited
		return v.(V)
	}
	limit := m.Limit
	if limit <= 0 {
		limit = Max
	}
	if m.n >= limit {
		if m.overflow == nil {
			v := m.New()
			m.overflow = &v
		}
		return *m.overflow
	}
	v := m.New()
	m.known.Store(host, v)
	m.n++
	return v
}
