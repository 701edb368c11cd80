package saferetry

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/internal/duelist"
)

func isDone(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

func TestAttemptCtxCancelClosesDoneAndDerived(t *testing.T) {
	a := &attemptCtx{parent: context.Background()}
	child, cancelChild := context.WithCancelCause(a) // as net/http does
	defer cancelChild(nil)
	require.NoError(t, a.Err())
	require.False(t, isDone(a))
	require.False(t, isDone(child))

	a.cancel(context.DeadlineExceeded, true)
	assert.True(t, isDone(a))
	assert.ErrorIs(t, a.Err(), context.DeadlineExceeded)
	assert.True(t, a.canceledByTimer())
	assert.True(t, isDone(child), "a derived context is canceled with its parent, synchronously")
	assert.ErrorIs(t, child.Err(), context.DeadlineExceeded)

	a.cancel(context.Canceled, false) // a second cancellation changes nothing
	assert.ErrorIs(t, a.Err(), context.DeadlineExceeded)
}

func TestAttemptCtxFollowsItsParent(t *testing.T) {
	type key struct{}
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), key{}, "v"))
	a := &attemptCtx{parent: parent}
	assert.Equal(t, "v", a.Value(key{}))
	done := a.Done() // asked before the parent is canceled: a watches it
	cancel(errors.New("caller gave up"))
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the parent's cancellation did not reach the attempt context")
	}
	assert.ErrorIs(t, a.Err(), context.Canceled)
	assert.False(t, a.canceledByTimer())

	// Err sees the parent's cancellation even when nobody asked for Done.
	parent2, cancel2 := context.WithCancel(context.Background())
	b := &attemptCtx{parent: parent2}
	cancel2()
	assert.ErrorIs(t, b.Err(), context.Canceled)
	assert.True(t, isDone(b))
}

func TestAttemptCtxDeliveredIgnoresItsTimeLimit(t *testing.T) {
	a := &attemptCtx{parent: context.Background()}
	a.deliver()
	a.cancel(context.DeadlineExceeded, true)
	assert.NoError(t, a.Err(), "once the response is delivered, the time limit no longer cancels the body")
	a.cancel(context.Canceled, false) // the caller closing the body
	assert.ErrorIs(t, a.Err(), context.Canceled)
}

func TestAttemptCtxAfterFuncStop(t *testing.T) {
	a := &attemptCtx{parent: context.Background()}
	ran := make(chan int, 3)
	stop1 := a.AfterFunc(func() { ran <- 1 })
	stop2 := a.AfterFunc(func() { ran <- 2 })
	a.AfterFunc(func() { ran <- 3 })
	assert.True(t, stop1())
	assert.False(t, stop1(), "a second stop reports it had already been stopped")
	assert.True(t, stop2())
	a.cancel(context.Canceled, false)
	assert.Equal(t, 3, <-ran)
	assert.Empty(t, ran)
	// Registered after cancellation: runs at once, in its own goroutine.
	late := make(chan struct{})
	assert.False(t, a.AfterFunc(func() { close(late) })())
	<-late
}

// The Transport's deadline lists expire an attempt context as its own
// timer would: canceled with context.DeadlineExceeded, marked as timed out;
// one removed in time is never canceled. testing/synctest provides the
// fake time.
func TestDeadlineListsExpireAttempts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var lists duelist.Shards[*attemptCtx]
		lists.AllowFakeClock() // made in this bubble, used only here
		now := time.Now()
		late := &attemptCtx{parent: context.Background()}
		onTime := &attemptCtx{parent: context.Background()}
		require.True(t, lists.Add(&late.limit, late, now.Add(time.Second), now))
		require.True(t, lists.Add(&onTime.limit, onTime, now.Add(time.Second), now))
		onTime.limit.Remove()
		time.Sleep(2 * time.Second)
		synctest.Wait()
		assert.ErrorIs(t, late.Err(), context.DeadlineExceeded)
		assert.True(t, late.canceledByTimer())
		assert.NoError(t, onTime.Err(), "an attempt removed in time is never canceled by the lists")
	})
}

// The call, which holds the first attempt's request and context, is the
// one allocation per request of the Transport's own: at 696 bytes or less
// it takes the 704-byte size class with its 8-byte malloc header (Go gives
// objects over 512 bytes that hold pointers one), one byte more and it
// takes 768. A field added to call or attemptCtx must be paid for.
func TestCallFitsItsSizeClass(t *testing.T) {
	assert.LessOrEqual(t, unsafe.Sizeof(call{}), uintptr(696))
}
