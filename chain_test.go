package saferetry

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/budget"
	"github.com/saferetry/saferetry/deadline"
)

// chain is three services on loopback, each its own http.Server, and a
// client: client -> top -> middle -> bottom. The top and the middle call
// the service below with a Transport of their own (3 attempts each, as the
// client's) and answer with its status, or 502 when they got none; the
// bottom fails every request with 503.
type chain struct {
	client *Transport
	url    string
	bottom atomic.Int64 // requests the bottom received
}

// newChain starts the chain. With pushback, every service is behind
// deadline.Middleware; without, none is. budgets says whether each
// Transport has a default budget of its own (a token bucket per host, as a
// process has, but refilled by successes alone, so that a slow run is not
// refilled by time while the outage lasts) or none.
func newChain(t *testing.T, pushback, budgets bool) *chain {
	c := &chain{}
	wrap := func(h http.Handler) http.Handler {
		if pushback {
			return deadline.Middleware(h)
		}
		return h
	}
	transport := func() *Transport {
		base := &http.Transport{}
		t.Cleanup(base.CloseIdleConnections)
		b := budget.Budget(budget.Unlimited())
		if budgets {
			b = budget.NewRegistry(func() budget.Budget {
				return budget.NewTokenBucket(budget.TokenBucketConfig{RefillTime: -1})
			})
		}
		return newTestTransport(base, WithBudget(b))
	}
	bottom := httptest.NewServer(wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.bottom.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	})))
	t.Cleanup(bottom.Close)
	url := bottom.URL
	for range 2 { // the middle, then the top
		tr, next := transport(), url
		srv := httptest.NewServer(wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, next, nil)
			if err != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			resp.Body.Close()
			w.WriteHeader(resp.StatusCode)
		})))
		t.Cleanup(srv.Close)
		url = srv.URL
	}
	c.client, c.url = transport(), url
	return c
}

// userRequests sends n user requests one after another and returns the
// requests the bottom received for each.
func (c *chain) userRequests(t *testing.T, n int) []int64 {
	per := make([]int64, n)
	for i := range per {
		before := c.bottom.Load()
		req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, c.url, nil)
		require.NoError(t, err)
		resp, err := c.client.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		per[i] = c.bottom.Load() - before
	}
	return per
}

func summary(per []int64) string {
	s := make([]string, len(per))
	var sum int64
	for i, n := range per {
		s[i], sum = fmt.Sprint(n), sum+n
	}
	return fmt.Sprintf("mean %.2f: %s", float64(sum)/float64(len(per)), strings.Join(s, " "))
}

// The bottom of a 3-tier chain with 3 attempts per layer, in a full outage:
// without budgets it receives 27 requests per user request without
// pushback, 3 with it (the middle retries; the layers above see its
// answer marked and do not).
func TestChainOfThreeServicesWithoutBudgets(t *testing.T) {
	for _, pushback := range []bool{false, true} {
		c := newChain(t, pushback, false)
		per := c.userRequests(t, 5)
		t.Logf("chain: bottom requests per user request, no budgets, pushback %v: %s", pushback, summary(per))
		want := int64(27)
		if pushback {
			want = 3
		}
		for i, n := range per {
			assert.Equal(t, want, n, "pushback %v, user request %d", pushback, i+1)
		}
	}
}

// With the default budgets (a token bucket per Transport and host) the
// buckets drain during the outage and the chain settles at 1 request per
// user request; with pushback it never sends more than 3.
func TestChainOfThreeServicesWithBudgets(t *testing.T) {
	const n = 60
	for _, pushback := range []bool{false, true} {
		c := newChain(t, pushback, true)
		per := c.userRequests(t, n)
		t.Logf("chain: bottom requests per user request, default budgets, pushback %v: %s", pushback, summary(per))
		if pushback {
			assert.LessOrEqual(t, slices.Max(per), int64(3), "the peak, with pushback")
		} else {
			assert.Equal(t, int64(27), per[0], "full buckets: every layer retries")
		}
		for i, got := range per[n-10:] {
			assert.Equal(t, int64(1), got, "pushback %v, user request %d: the buckets are drained",
				pushback, n-10+i+1)
		}
	}
}
