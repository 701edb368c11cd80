package budget

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRegistryPerHostIsolation(t *testing.T) {
	r := NewRegistry(nil)
	a := r.For("a.example")
	b := r.For("b.example:8443")
	require.NotSame(t, a.(*TokenBucket), b.(*TokenBucket))
	require.Same(t, a.(*TokenBucket), r.For("A.Example").(*TokenBucket), "hosts compare case-insensitively")
	require.NotSame(t, b.(*TokenBucket), r.For("b.example").(*TokenBucket), "the port is part of the host")

	for range 100 {
		a.AcquireRetry(t0, false) // an outage of a.example drains its budget
	}
	require.Equal(t, 10, a.Available(t0))
	require.Equal(t, 500, b.Available(t0), "b.example keeps its retries")
	_, ok := r.For("b.example:8443").AcquireRetry(t0, false)
	require.True(t, ok)
}

func TestRegistryNewBudget(t *testing.T) {
	var made atomic.Int64
	r := NewRegistry(func() Budget { made.Add(1); return NewRatio(RatioConfig{}) })
	require.IsType(t, &Ratio{}, r.For("x"))
	r.For("x")
	require.Equal(t, int64(1), made.Load(), "created once per host")

	nilMaker := NewRegistry(func() Budget { return nil })
	require.IsType(t, &TokenBucket{}, nilMaker.For("x"), "a nil budget falls back to the default bucket")
	typedNil := NewRegistry(func() Budget { return (*TokenBucket)(nil) })
	b := typedNil.For("x")
	require.NotNil(t, b.(*TokenBucket), "a typed nil budget falls back to the default bucket")
	require.Equal(t, 500, b.Available(t0))
}

func TestRegistryMaxHosts(t *testing.T) {
	r := NewRegistry(nil)
	r.hosts.Limit = 2
	h1, h2 := r.For("h1"), r.For("h2")
	o3, o4 := r.For("h3"), r.For("h4")
	require.Same(t, o3.(*TokenBucket), o4.(*TokenBucket), "hosts past the bound share the overflow budget")
	require.NotSame(t, h1.(*TokenBucket), o3.(*TokenBucket))
	require.NotSame(t, h2.(*TokenBucket), o3.(*TokenBucket))
	require.Same(t, h1.(*TokenBucket), r.For("h1").(*TokenBucket), "known hosts keep their own budget")
	require.Zero(t, NewRegistry(nil).hosts.Limit, "hosts.Max")
}

func TestRegistryConcurrent(t *testing.T) {
	var made atomic.Int64
	r := NewRegistry(func() Budget { made.Add(1); return NewTokenBucket(TokenBucketConfig{}) })
	var wg sync.WaitGroup
	got := make([][]Budget, 64)
	for w := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				b := r.For(fmt.Sprintf("host%d", (w+i)%10))
				b.AcquireRetry(t0, true)
				b.OnSuccess(t0, 5)
				got[w] = append(got[w], b)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(10), made.Load(), "exactly one budget per host")
	for w := range got {
		for i, b := range got[w] {
			require.Same(t, r.For(fmt.Sprintf("host%d", (w+i)%10)).(*TokenBucket), b.(*TokenBucket))
		}
	}
	for i := range 10 {
		require.Equal(t, 500, r.For(fmt.Sprintf("host%d", i)).Available(t0), "every refund came back")
	}
}

func TestRegistryIsABudgetForTheEmptyHost(t *testing.T) {
	r := NewRegistry(nil)
	var b Budget = r
	cost, ok := b.AcquireRetry(t0, false)
	require.True(t, ok)
	require.Equal(t, 14, cost)
	require.Equal(t, 486, b.Available(t0))
	require.Equal(t, 486, r.For("").Available(t0), "the same budget as the host \"\"")
	require.Equal(t, 500, r.For("a.example").Available(t0), "other hosts untouched")
	b.OnRequest(t0)
	b.OnSuccess(t0, cost)
	require.Equal(t, 500, r.For("").Available(t0), "the refund reached it too")
}
