// Package duelist keeps entries in order of their due time under one timer,
// armed for the first. Adding or removing an entry costs a lock and a few
// pointer writes, where a timer of its own would cost a runtime timer (two
// allocations, and an insertion into and a removal from the runtime's timer
// heap) for a time that most entries are removed before. The Transport
// times its attempts' limits with it, the idempotency middleware its runs'
// first heartbeats.
package duelist

import (
	"math/rand/v2"
	"sync"
	"time"
)

// Owner is what a Node is embedded in. Expire is called once when the
// node's due time has come while it was queued, in the timer's goroutine,
// outside the list's lock: it must not block.
type Owner interface{ Expire() }

// Node is an entry of a List, embedded in its owner. Its zero value is
// ready to Add.
type Node[T Owner] struct {
	due        time.Time
	owner      T
	list       *List[T] // set by an Add that queued it, never changed
	prev, next *Node[T] // guarded by list's lock
	queued     bool     // guarded by list's lock
}

// Due returns the due time the node was added with (zero before Add).
func (n *Node[T]) Due() time.Time { return n.due }

// Remove takes n out of its list, if it is still queued. Call it from the
// goroutine that added n (or after synchronizing with it).
func (n *Node[T]) Remove() {
	if l := n.list; l != nil {
		l.mu.Lock()
		l.unlink(n)
		l.mu.Unlock()
	}
}

// List is a list of nodes in order of due time. The timer is armed for the
// head; when the node it was armed for is removed first, it fires for
// nothing and re-arms for the next. The zero value is an empty list. Safe
// for concurrent use.
type List[T Owner] struct {
	mu         sync.Mutex
	head, tail *Node[T]
	timer      *time.Timer
	armedFor   time.Time // when timer fires; zero when it is not armed
	fakeClock  bool      // Add takes times without a monotonic reading (AllowFakeClock)
}

// MaxWalk bounds how far from the tail Add looks for the place of a node
// due earlier than the tail (entries added concurrently read the clock and
// then queue in a slightly different order).
const MaxWalk = 8

// Add queues n, embedded in owner, to expire at due, now being the current
// time (of the clock due is read from). It returns false, queuing nothing,
// when n's place is more than MaxWalk nodes before the tail, and when now
// has no monotonic clock reading (time.Now inside a testing/synctest
// bubble) unless AllowFakeClock was called: a list's one timer runs on the
// clock it was made on, and a bubble's clock is another, which ends with
// its bubble. A refused n must be timed by other means (a timer of its
// own, which runs on its own clock). Either way n.Due() reports due from
// now on. A node is added once.
func (l *List[T]) Add(n *Node[T], owner T, due, now time.Time) bool {
	n.due, n.owner = due, owner
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.fakeClock && now == now.Round(0) { // Round(0) strips a monotonic reading: there was none
		return false
	}
	after := l.tail // n goes right after this one (nil: at the head)
	for i := 0; after != nil && due.Before(after.due); i++ {
		if i == MaxWalk {
			return false
		}
		after = after.prev
	}
	n.list, n.prev, n.queued = l, after, true
	if after == nil {
		n.next, l.head = l.head, n
	} else {
		n.next, after.next = after.next, n
	}
	if n.next == nil {
		l.tail = n
	} else {
		n.next.prev = n
	}
	if l.armedFor.IsZero() || due.Before(l.armedFor) {
		l.arm(due, now)
	}
	return true
}

func (l *List[T]) unlink(n *Node[T]) {
	if !n.queued {
		return
	}
	if n.prev == nil {
		l.head = n.next
	} else {
		n.prev.next = n.next
	}
	if n.next == nil {
		l.tail = n.prev
	} else {
		n.next.prev = n.prev
	}
	n.prev, n.next, n.queued = nil, nil, false
}

// arm makes the timer fire at due. Called with l.mu held.
func (l *List[T]) arm(due, now time.Time) {
	d := due.Sub(now)
	if l.timer == nil {
		l.timer = time.AfterFunc(d, l.fire)
	} else {
		l.timer.Reset(d)
	}
	l.armedFor = due
}

// fire expires every node whose time has come and re-arms the timer for
// the next one.
func (l *List[T]) fire() {
	var due []T
	l.mu.Lock()
	now := time.Now()
	for n := l.head; n != nil && !n.due.After(now); n = l.head {
		l.unlink(n)
		due = append(due, n.owner)
	}
	l.armedFor = time.Time{}
	if l.head != nil {
		l.arm(l.head.due, now)
	}
	l.mu.Unlock()
	for _, o := range due {
		o.Expire()
	}
}

// shards is how many Lists a Shards holds.
const shards = 8

// Shards is a few Lists for nodes added from many goroutines at once: each
// Add picks one at random, so that they seldom wait for one lock (with a
// single List, 16 clients on 2 cores spent more time waiting for its lock
// than holding it). A List is 64 bytes (TestListIsACacheLineLong), so no
// two of their locks share a cache line. The zero value is ready to use.
// Safe for concurrent use.
type Shards[T Owner] [shards]List[T]

// Add adds n to one of the lists, as List.Add does.
func (s *Shards[T]) Add(n *Node[T], owner T, due, now time.Time) bool {
	return s[rand.Uint32()%shards].Add(n, owner, due, now)
}

// AllowFakeClock makes every list of s take times without a monotonic
// reading: for a test that makes s inside its testing/synctest bubble and
// uses it there only. Call it before s is used.
func (s *Shards[T]) AllowFakeClock() {
	for i := range s {
		s[i].fakeClock = true
	}
}

// Len returns how many nodes are queued in s. It walks the lists: for
// tests and diagnostics, not for a hot path.
func (s *Shards[T]) Len() int {
	n := 0
	for i := range s {
		l := &s[i]
		l.mu.Lock()
		for x := l.head; x != nil; x = x.next {
			n++
		}
		l.mu.Unlock()
	}
	return n
}
