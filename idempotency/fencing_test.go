package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// partitioned is a memstore whose heartbeats fail while cut reports true:
// the owner is cut off from the store, so its lease runs out under it.
type partitioned struct {
	*memstore.Store
	cut atomic.Bool
}

var errPartition = errors.New("network partition")

func (p *partitioned) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	if p.cut.Load() {
		return errPartition
	}
	return p.Store.Heartbeat(ctx, l, until)
}

// Handler A stalls past its lease (its heartbeats do not get through), B
// takes the record over and completes; A's late completion is rejected,
// A's business write never commits (with a Transactor), and B's record
// stands. testing/synctest provides the time.
func TestFencingStalledOwner(t *testing.T) {
	for _, transactor := range []bool{true, false} {
		t.Run(fmt.Sprintf("transactor=%v", transactor), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := &partitioned{Store: memstore.New()}
				var store idempotency.Store = mem
				if !transactor {
					store = plainStore{mem}
				}
				var (
					calls     atomic.Int64
					committed []string // business writes that committed
					mu        sync.Mutex
					aStarted  = make(chan struct{})
					aResume   = make(chan struct{})
				)
				next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					who := "B"
					if calls.Add(1) == 1 {
						who = "A"
						close(aStarted)
						<-aResume // stalled: a GC pause, a frozen VM, a slow downstream
					}
					run, _ := idempotency.FromContext(r.Context())
					write := func() { mu.Lock(); committed = append(committed, who); mu.Unlock() }
					if u, _, err := run.Unit(r.Context()); err == nil {
						require.NoError(t, memstore.OnCommit(u, write))
					} else {
						require.ErrorIs(t, err, errors.ErrUnsupported)
						write() // no transaction: the write happens regardless
					}
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, "charged by "+who)
				})
				h := idempotency.New(store, idempotency.WithAnonymousKeys(true), idempotency.WithLease(30*time.Second),
					idempotency.WithLogger(quiet)).Wrap(next)

				aDone := make(chan *httptest.ResponseRecorder)
				mem.cut.Store(true)
				go func() { aDone <- send(t, h, "k", `{"amount":1}`) }()
				<-aStarted

				// Before the lease ends, B is told to wait.
				time.Sleep(29 * time.Second)
				mem.cut.Store(false)
				b := send(t, h, "k", `{"amount":1}`)
				require.Equal(t, http.StatusConflict, b.Code)
				require.Contains(t, b.Body.String(), idempotency.CodeInProgress)

				// After it, B takes over (generation 2) and completes.
				time.Sleep(2 * time.Second)
				b = send(t, h, "k", `{"amount":1}`)
				require.Equal(t, http.StatusCreated, b.Code)
				require.Equal(t, "charged by B", b.Body.String())
				rec, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "/payments", Key: "k"})
				require.NoError(t, err)
				require.Equal(t, idempotency.Completed, rec.State)
				require.EqualValues(t, 2, rec.Generation)

				// A wakes up; its completion is fenced off, and its client
				// gets B's stored response, marked replayed.
				close(aResume)
				a := <-aDone
				require.Equal(t, http.StatusCreated, a.Code)
				require.Equal(t, "charged by B", a.Body.String())
				require.Equal(t, "true", a.Header().Get(idempotency.ReplayedHeader))

				rec2, err := mem.Get(t.Context(), rec.Scope)
				require.NoError(t, err)
				require.Equal(t, rec.Owner, rec2.Owner)
				require.Equal(t, "charged by B", string(rec2.Response.Body))
				if transactor {
					require.Equal(t, []string{"B"}, committed, "A's write must roll back with its fenced unit")
				} else {
					require.Equal(t, []string{"B", "A"}, committed, "without a transaction A's write stands (documented)")
				}
				// Later retries replay B.
				r := send(t, h, "k", `{"amount":1}`)
				require.Equal(t, "charged by B", r.Body.String())
				require.Equal(t, "true", r.Header().Get(idempotency.ReplayedHeader))
			})
		})
	}
}

// WithMaxInProgressWait: a duplicate waits, reading the record every 100
// ms, and gets the replay once the first completes; with no completion it
// gets 409 when the wait runs out, and not before.
func TestInProgressWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var gets atomic.Int64
		obs := idempotency.Observer{StoreCall: func(_ context.Context, e idempotency.Event) {
			if e.Op == "get" {
				gets.Add(1)
			}
		}}
		gate := make(chan struct{})
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			<-gate
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "done")
		})
		h := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithMaxInProgressWait(2*time.Second),
			idempotency.WithLogger(quiet), idempotency.WithObserver(obs)).Wrap(next)

		first := make(chan *httptest.ResponseRecorder)
		go func() { first <- send(t, h, "k", `{}`) }()
		synctest.Wait()
		go func() {
			time.Sleep(250 * time.Millisecond) // the first finishes between the second and third read
			close(gate)
		}()
		start := time.Now()
		dup := send(t, h, "k", `{}`)
		require.Equal(t, http.StatusCreated, dup.Code)
		require.Equal(t, "done", dup.Body.String())
		require.Equal(t, "true", dup.Header().Get(idempotency.ReplayedHeader))
		require.Equal(t, "done", (<-first).Body.String())
		require.Equal(t, 300*time.Millisecond, time.Since(start))
		require.EqualValues(t, 3, gets.Load())

		// A key that never completes: 409 after 2 s.
		block := make(chan struct{})
		h2 := idempotency.New(mem, idempotency.WithAnonymousKeys(true), idempotency.WithMaxInProgressWait(2*time.Second),
			idempotency.WithLogger(quiet)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-block }))
		done := make(chan struct{})
		go func() { send(t, h2, "k2", `{}`); close(done) }()
		synctest.Wait()
		start = time.Now()
		dup = send(t, h2, "k2", `{}`)
		require.Equal(t, http.StatusConflict, dup.Code)
		require.Equal(t, "1", dup.Header().Get("Retry-After"))
		require.Equal(t, 2*time.Second, time.Since(start))
		close(block)
		<-done
	})
}

// A request whose context ends while it waits on a key in progress, from
// a deadline set in front of the middleware while its client is still
// connected, gets the in-progress answer: not net/http's empty 200, which
// a client would take for a success.
func TestInProgressWaitCutByTheRequestsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		block := make(chan struct{})
		h := idempotency.New(memstore.New(), idempotency.WithAnonymousKeys(true),
			idempotency.WithMaxInProgressWait(10*time.Second), idempotency.WithLogger(quiet)).
			Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-block }))
		outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), 200*time.Millisecond)
			defer cancel()
			h.ServeHTTP(w, r.WithContext(ctx))
		})
		done := make(chan struct{})
		go func() { send(t, h, "k", `{}`); close(done) }()
		synctest.Wait()
		start := time.Now()
		dup := send(t, outer, "k", `{}`)
		require.Equal(t, http.StatusConflict, dup.Code)
		require.Equal(t, "1", dup.Header().Get("Retry-After"))
		require.Contains(t, dup.Body.String(), "idempotency_request_in_progress")
		require.Equal(t, 200*time.Millisecond, time.Since(start))
		close(block)
		<-done
	})
}
