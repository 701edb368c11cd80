package duelist

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// entry is an Owner that records when it expired.
type entry struct {
	node    Node[*entry]
	name    string
	mu      sync.Mutex
	expired []time.Duration
	start   time.Time
}

func (e *entry) Expire() {
	e.mu.Lock()
	e.expired = append(e.expired, time.Since(e.start))
	e.mu.Unlock()
}

func (e *entry) times() []time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.expired
}

func order(l *List[*entry]) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var names []string
	for n := l.head; n != nil; n = n.next {
		names = append(names, n.owner.name)
	}
	return names
}

// stop stops l's timer, if it has one.
func stop(l *List[*entry]) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.timer != nil {
		l.timer.Stop()
	}
}

// Nodes added out of order within MaxWalk find their place, expire once
// each at their due time, and a removed one never expires; the timer
// re-arms for the next node after each firing, also when the node it was
// armed for was removed. testing/synctest provides the fake time.
func TestListExpiresInDueOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := List[*entry]{fakeClock: true} // made in this bubble, used only here
		start := time.Now()
		mk := func(name string) *entry { return &entry{name: name, start: start} }
		a, b, c, d, e := mk("a"), mk("b"), mk("c"), mk("d"), mk("e")
		require.True(t, l.Add(&c.node, c, start.Add(30*time.Second), start))
		require.True(t, l.Add(&a.node, a, start.Add(10*time.Second), start))
		require.True(t, l.Add(&e.node, e, start.Add(time.Hour), start))
		require.True(t, l.Add(&b.node, b, start.Add(20*time.Second), start))
		require.True(t, l.Add(&d.node, d, start.Add(40*time.Second), start))
		assert.Equal(t, []string{"a", "b", "c", "d", "e"}, order(&l))
		assert.Equal(t, start.Add(20*time.Second), b.node.Due())

		a.node.Remove() // the head, which the timer is armed for
		b.node.Remove()
		b.node.Remove() // a second Remove does nothing
		time.Sleep(35 * time.Second)
		synctest.Wait()
		assert.Empty(t, a.times(), "a removed node never expires")
		assert.Empty(t, b.times())
		assert.Equal(t, []time.Duration{30 * time.Second}, c.times())
		assert.Equal(t, []string{"d", "e"}, order(&l))
		time.Sleep(10 * time.Second)
		synctest.Wait()
		assert.Equal(t, []time.Duration{40 * time.Second}, d.times())
		c.node.Remove() // already expired: nothing to do
		e.node.Remove()
		assert.Empty(t, order(&l))
		stop(&l)
	})
}

// A node due more than MaxWalk places before the tail is refused, and
// reports its due time all the same.
func TestListRefusesAPlaceTooFarBack(t *testing.T) {
	var l List[*entry]
	now := time.Now()
	for i := range MaxWalk + 1 {
		require.True(t, l.Add(&(&entry{}).node, &entry{}, now.Add(time.Hour+time.Duration(i)), now))
	}
	early := &entry{}
	assert.False(t, l.Add(&early.node, early, now.Add(time.Minute), now), "more than MaxWalk places back")
	assert.False(t, early.node.queued)
	assert.Equal(t, now.Add(time.Minute), early.node.Due())
	early.node.Remove() // not queued: nothing to do
	assert.Len(t, order(&l), MaxWalk+1)
	stop(&l)
}

// Shards spread nodes over their lists, and every node expires at its time
// whichever list it is in.
func TestShardsExpireEveryNode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s Shards[*entry]
		s.AllowFakeClock()
		start := time.Now()
		entries := make([]*entry, 64)
		for i := range entries {
			entries[i] = &entry{start: start}
			require.True(t, s.Add(&entries[i].node, entries[i], start.Add(time.Duration(i+1)*time.Second), start))
		}
		used := 0
		for i := range s {
			if len(order(&s[i])) > 0 {
				used++
			}
		}
		assert.Greater(t, used, 1, "64 nodes in one list out of 8")
		assert.Equal(t, 64, s.Len())
		time.Sleep(65 * time.Second)
		synctest.Wait()
		assert.Zero(t, s.Len())
		for i, e := range entries {
			assert.Equal(t, []time.Duration{time.Duration(i+1) * time.Second}, e.times(), "node %d", i)
		}
		for i := range s {
			stop(&s[i])
		}
	})
}

func TestListIsACacheLineLong(t *testing.T) {
	assert.Equal(t, uintptr(64), unsafe.Sizeof(List[*entry]{}))
}

// Inside a testing/synctest bubble time.Now has no monotonic reading: a
// list refuses such a time (its timer may belong to another clock) unless
// told that it lives in the bubble; outside, it takes the wall clock.
func TestListRefusesAFakeClockUnlessAllowed(t *testing.T) {
	var outside List[*entry]
	now := time.Now()
	e := &entry{}
	require.True(t, outside.Add(&e.node, e, now.Add(time.Hour), now))
	e.node.Remove()
	stop(&outside)
	synctest.Test(t, func(t *testing.T) {
		var s Shards[*entry]
		now := time.Now()
		e := &entry{start: now}
		assert.False(t, s.Add(&e.node, e, now.Add(time.Second), now), "a bubble's time")
		assert.Equal(t, now.Add(time.Second), e.node.Due())
		s.AllowFakeClock()
		f := &entry{start: now}
		require.True(t, s.Add(&f.node, f, now.Add(time.Second), now))
		time.Sleep(2 * time.Second)
		synctest.Wait()
		assert.Equal(t, []time.Duration{time.Second}, f.times())
		for i := range s {
			stop(&s[i])
		}
	})
}
