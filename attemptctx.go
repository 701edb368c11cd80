package saferetry

import (
	"context"
	"sync"
	"time"

	"github.com/saferetry/saferetry/internal/duelist"
)

// attemptCtx is the context of one attempt: its parent's values and
// deadline, canceled when the parent is, when the attempt's timer fires, or
// when the attempt ends. It does what context.WithCancelCause plus
// time.AfterFunc did, without their four allocations per request: the first
// attempt's attemptCtx lives inside the call, its done channel is made only
// when someone asks for it (an in-memory base transport never does), and its
// time limit is enforced by the Transport's deadline lists (package duelist).
//
// It implements the AfterFunc method that package context looks for, so a
// context derived from it (net/http derives one per request) registers a
// callback instead of starting a goroutine to watch it.
type attemptCtx struct {
	parent context.Context
	// limit is the attempt's place in the Transport's deadline lists: its
	// Due is when the attempt's time limit ends (wall clock), set before
	// the context is used.
	limit duelist.Node[*attemptCtx]

	mu         sync.Mutex
	done       chan struct{} // made by Done, or closedChan if canceled first
	err        error         // nil until canceled
	afterFuncs []*afterFunc  // run once when canceled
	first      afterFunc     // the first registration's storage (usually the only one)
	firstSlot  [1]*afterFunc // and its slice's
	stopParent func() bool   // the registration on parent made by Done
	// Side by side: the call that holds the first attempt's context must
	// stay within the 704-byte size class (TestCallFitsItsSizeClass).
	timedOut  bool // canceled by the attempt timer
	delivered bool // its response went to the caller: no more timeouts
}

// afterFunc is one AfterFunc registration.
type afterFunc struct{ f func() }

// closedChan is the done channel of an attemptCtx canceled before anyone
// asked for its channel.
var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Deadline returns the earlier of the parent's deadline and the end of the
// attempt's time limit (its Err is then context.DeadlineExceeded).
func (a *attemptCtx) Deadline() (time.Time, bool) {
	d, ok := a.parent.Deadline()
	if at := a.limit.Due(); !at.IsZero() && (!ok || at.Before(d)) {
		return at, true
	}
	return d, ok
}

// Value returns the parent's value for key.
func (a *attemptCtx) Value(key any) any { return a.parent.Value(key) }

// Done returns a channel closed when the attempt is canceled.
func (a *attemptCtx) Done() <-chan struct{} {
	a.mu.Lock()
	if a.done != nil {
		d := a.done
		a.mu.Unlock()
		return d
	}
	a.done = make(chan struct{})
	d := a.done
	a.mu.Unlock()
	// From now on a cancellation of the parent must close d: watch it.
	if pd := a.parent.Done(); pd != nil {
		select {
		case <-pd:
			a.cancelFromParent()
		default:
			stop := context.AfterFunc(a.parent, a.cancelFromParent)
			a.mu.Lock()
			if a.err == nil {
				a.stopParent = stop
				stop = nil
			}
			a.mu.Unlock()
			if stop != nil {
				stop() // canceled meanwhile: the registration is not needed
			}
		}
	}
	return d
}

// Err returns nil until the attempt is canceled, then why: the parent's
// error, context.DeadlineExceeded for the attempt timer, or
// context.Canceled when the attempt ended.
//
// Seeing the parent canceled, Err cancels a, which runs the functions
// registered with AfterFunc synchronously: safe because only package context
// registers them (to cancel contexts derived from a), and those take no lock
// that a caller of Err could hold.
func (a *attemptCtx) Err() error {
	a.mu.Lock()
	err := a.err
	a.mu.Unlock()
	if err != nil {
		return err
	}
	if a.parent.Err() != nil {
		a.cancelFromParent()
		a.mu.Lock()
		err = a.err
		a.mu.Unlock()
	}
	return err
}

// AfterFunc arranges for f to run once a is canceled (in its own goroutine
// if a already is: the caller may hold a lock that f takes); the returned stop unregisters f and reports
// whether it did so before f was started. It is the method package context
// uses to propagate cancellation to a derived context.
func (a *attemptCtx) AfterFunc(f func()) (stop func() bool) {
	a.Done() // the parent's cancellation must reach a from now on
	a.mu.Lock()
	if a.err != nil {
		a.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	var af *afterFunc
	if a.first.f == nil && a.afterFuncs == nil {
		// The usual single registration (net/http's request context)
		// costs only the stop function.
		a.first.f = f
		af = &a.first
		a.afterFuncs = a.firstSlot[:1:1]
		a.afterFuncs[0] = af
	} else {
		af = &afterFunc{f: f}
		a.afterFuncs = append(a.afterFuncs, af)
	}
	a.mu.Unlock()
	return func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		for i, x := range a.afterFuncs {
			if x == af {
				a.afterFuncs = append(a.afterFuncs[:i], a.afterFuncs[i+1:]...)
				return true
			}
		}
		return false
	}
}

func (a *attemptCtx) String() string { return "saferetry.attemptContext" }

func (a *attemptCtx) cancelFromParent() { a.cancel(a.parent.Err(), false) }

// cancel cancels a with err unless it already is. timedOut marks a
// cancellation by the attempt timer.
func (a *attemptCtx) cancel(err error, timedOut bool) {
	a.mu.Lock()
	if a.err != nil || (timedOut && a.delivered) {
		a.mu.Unlock()
		return
	}
	a.err, a.timedOut = err, timedOut
	if a.done == nil {
		a.done = closedChan
	} else {
		close(a.done)
	}
	funcs, stop := a.afterFuncs, a.stopParent
	a.afterFuncs, a.stopParent = nil, nil
	a.mu.Unlock()
	if stop != nil {
		stop()
	}
	// Synchronously: the registered functions are package context's
	// cancellation of derived contexts, which do not block and take no lock
	// of ours (a's own is released).
	for _, af := range funcs {
		af.f()
	}
}

// deliver marks the attempt's response as handed to the caller: from now
// on only the parent or the caller closing the body cancels a, never the
// attempt's time limit (which bounds the wait for response headers, not the
// body). If the limit canceled a first, the body's reads fail with that
// cancellation, as they would have with a timer of its own.
func (a *attemptCtx) deliver() {
	a.mu.Lock()
	a.delivered = true
	a.mu.Unlock()
}

// canceledByTimer reports whether the attempt timer canceled a.
func (a *attemptCtx) canceledByTimer() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.timedOut
}

// Expire cancels a when its time limit has come: the Transport's deadline
// lists call it, or the attempt's own timer when the lists refused it.
func (a *attemptCtx) Expire() { a.cancel(context.DeadlineExceeded, true) }
