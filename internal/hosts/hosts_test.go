package hosts

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
)

type value struct{ n int64 }

func TestEachHostHasItsOwnValueUpToTheLimit(t *testing.T) {
	var made atomic.Int64
	m := Map[*value]{New: func() *value { return &value{made.Add(1)} }, Limit: 2}
	a, b := m.For("a.example:443"), m.For("b.example:443")
	assert.NotSame(t, a, b)
	assert.Same(t, a, m.For("A.Example:443"), "hosts compare case-insensitively")
	assert.NotSame(t, a, m.For("a.example"), "and otherwise as given")
	over := m.For("c.example")
	assert.Same(t, over, m.For("d.example"), "the hosts past the limit share one")
	assert.Same(t, b, m.For("b.example:443"), "known hosts keep their own")
	assert.Equal(t, int64(3), made.Load())
}

func TestTheDefaultLimitIsMax(t *testing.T) {
	m := Map[*value]{New: func() *value { return &value{} }}
	own := map[*value]bool{}
	for i := range Max + 2 {
		own[m.For(fmt.Sprintf("host-%d", i))] = true
	}
	assert.Len(t, own, Max+1, "Max hosts of their own, and one shared")
}

func TestConcurrentFirstUsesCreateOneValue(t *testing.T) {
	var made atomic.Int64
	m := Map[*value]{New: func() *value { made.Add(1); return &value{} }}
	var wg sync.WaitGroup
	got := make([]*value, 16)
	for i := range got {
		wg.Go(func() { got[i] = m.For("h") })
	}
	wg.Wait()
	assert.Equal(t, int64(1), made.Load())
	for _, v := range got {
		assert.Same(t, got[0], v)
	}
}
