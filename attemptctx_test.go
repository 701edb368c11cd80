package saferetry

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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

func TestDeadlineQueueCancelsInDueOrder(t *testing.T) {
	var q deadlineQueue
	now := time.Now()
	ctxs := make([]*attemptCtx, 4)
	for i := range ctxs {
		ctxs[i] = &attemptCtx{parent: context.Background()}
	}
	// Queued out of order within the walk limit: each finds its place.
	for i, d := range []time.Duration{10 * time.Millisecond, 20 * time.Millisecond, 30 * time.Millisecond, time.Hour} {
		ctxs[i].limitAt = now.Add(d)
	}
	require.True(t, q.add(ctxs[2], now))
	require.True(t, q.add(ctxs[0], now))
	require.True(t, q.add(ctxs[3], now))
	require.True(t, q.add(ctxs[1], now))
	var order []*attemptCtx
	for a := q.head; a != nil; a = a.next {
		order = append(order, a)
	}
	assert.Equal(t, ctxs, order)

	q.remove(ctxs[1]) // ended in time
	deadline := time.Now().Add(10 * time.Second)
	for !(isDone(ctxs[0]) && isDone(ctxs[2])) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	assert.True(t, ctxs[0].canceledByTimer())
	assert.True(t, ctxs[2].canceledByTimer())
	assert.False(t, isDone(ctxs[1]), "a removed attempt is never canceled by the queue")
	assert.False(t, isDone(ctxs[3]))
	q.mu.Lock()
	assert.Same(t, ctxs[3], q.head)
	assert.Equal(t, ctxs[3].limitAt, q.armedFor, "re-armed for the next one due")
	q.mu.Unlock()
	q.remove(ctxs[3])
	q.timer.Stop()
}

func TestDeadlineQueueRefusesAPlaceTooFarBack(t *testing.T) {
	var q deadlineQueue
	now := time.Now()
	for i := range maxQueueWalk + 1 {
		require.True(t, q.add(&attemptCtx{parent: context.Background(), limitAt: now.Add(time.Hour + time.Duration(i))}, now))
	}
	early := &attemptCtx{parent: context.Background(), limitAt: now.Add(time.Minute)}
	assert.False(t, q.add(early, now), "more than maxQueueWalk places back: timed by its own timer")
	assert.False(t, early.queued)
	q.timer.Stop()
}
