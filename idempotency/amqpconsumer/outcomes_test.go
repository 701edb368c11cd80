package amqpconsumer_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/amqpconsumer"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// rig is one queue, a SQLite store and Handlers consuming in this process.
type rig struct {
	t      *testing.T
	url    string
	conn   *amqp.Connection
	ch     *amqp.Channel
	q      testQueue
	db     *sql.DB
	store  *sqlstore.Store
	mw     *idempotency.Middleware
	refuse atomic.Int64 // in-progress refusals seen by the Middleware
}

func newRig(t *testing.T) *rig {
	r := &rig{t: t, url: amqpURL(t)}
	r.conn, r.ch = dial(t, r.url)
	if err := r.ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	r.q = newQueue(t, r.url)
	var err error
	r.db, r.store, err = newDB(t, false).openStore(t.Context(), true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.db.Close() })
	r.mw = idempotency.New(r.store, idempotency.WithLogger(nil),
		idempotency.WithLease(time.Second),
		idempotency.WithObserver(idempotency.Observer{
			Refused: func(_ context.Context, e idempotency.Event) {
				if e.Code == idempotency.CodeInProgress {
					r.refuse.Add(1)
				}
			}}))
	return r
}

// consume runs h.Consume in n goroutines, each on a channel of its own,
// until the test ends.
func (r *rig) consume(h *amqpconsumer.Handler, n int) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		ch, err := r.conn.Channel()
		if err == nil {
			err = ch.Qos(1, 0, false)
		}
		if err != nil {
			r.t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := h.Consume(ctx, ch, r.q.name); err != nil {
				r.t.Error(err)
			}
		}()
	}
	r.t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// publish publishes body under msgID ("" for none) with headers kv, and
// returns msgID.
func (r *rig) publish(msgID, body string, kv ...string) string {
	h := amqp.Table{}
	for i := 0; i+1 < len(kv); i += 2 {
		h[kv[i]] = kv[i+1]
	}
	dc, err := r.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", r.q.name,
		false, false, amqp.Publishing{MessageId: msgID, Headers: h, Body: []byte(body),
			DeliveryMode: amqp.Persistent})
	if err == nil {
		if ok, werr := dc.WaitContext(context.Background()); werr != nil || !ok {
			err = fmt.Errorf("not confirmed: %v", werr)
		}
	}
	if err != nil {
		r.t.Fatal(err)
	}
	return msgID
}

// settled waits until cond holds and the queue and the delay queue are
// empty, three polls in a row.
func (r *rig) settled(cond func() bool) {
	r.t.Helper()
	calm := 0
	eventually(r.t, 30*time.Second, "settled", func() bool {
		if cond() && ready(r.t, r.ch, r.q.name) == 0 &&
			ready(r.t, r.ch, amqpconsumer.DelayQueue(r.q.name)) == 0 {
			calm++
		} else {
			calm = 0
		}
		time.Sleep(100 * time.Millisecond)
		return calm >= 3
	})
}

// dead returns the dead-letter queue's message ids (taking them).
func (r *rig) dead() []string {
	var out []string
	for _, d := range r.q.deadLetters(r.t, r.ch) {
		out = append(out, d.MessageId)
	}
	slices.Sort(out)
	return out
}

// calls counts a handler's executions by business key.
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) add(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[k]++
	return c.n[k]
}

func (c *calls) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

// businessKey is a key function: the Business-Key header.
func businessKey(d amqp.Delivery) (string, error) {
	if k, _ := d.Headers["Business-Key"].(string); k != "" {
		return k, nil
	}
	return "", errors.New("no Business-Key header")
}

// TestOutcomes checks what each outcome does to its message, on a real
// RabbitMQ: a fresh message runs, is stored and acknowledged; its
// duplicate under a new message id is acknowledged without running; a
// failure that wrote first is rolled back and comes back after the
// backoff; a failure on every delivery, a definitive failure and poison
// messages are dead-lettered; a definitive failure is replayed to its
// duplicate.
func TestOutcomes(t *testing.T) {
	r := newRig(t)
	var c calls
	h, err := amqpconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			k, _ := d.Headers["Business-Key"].(string)
			n := c.add(k)
			if err := effect(ctx, k); err != nil {
				return err
			}
			switch body := string(d.Body); {
			case body == "decline":
				return fmt.Errorf("card declined: %w", idempotency.ErrDefinitive)
			case body == "fail":
				return errors.New("the network is down")
			case body == "flaky" && n <= 2:
				return errors.New("timed out") // after the write: rolled back
			}
			return nil
		},
		amqpconsumer.WithKey(businessKey), amqpconsumer.WithMaxAttempts(3),
		amqpconsumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond),
		amqpconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 2)

	r.publish("m-1", "pay", "Business-Key", "order-1")
	r.publish("m-2", "pay", "Business-Key", "order-1")
	r.publish("m-3", "flaky", "Business-Key", "order-2")
	r.publish("m-4", "fail", "Business-Key", "order-3")
	r.publish("m-5", "decline", "Business-Key", "order-4")
	r.publish("m-6", "pay")
	r.publish("m-7", "pay more", "Business-Key", "order-1")
	r.settled(func() bool { return ready(t, r.ch, r.q.dead) >= 4 && c.get("order-2") >= 3 })
	r.publish("m-8", "decline", "Business-Key", "order-4")
	r.settled(func() bool { return ready(t, r.ch, r.q.dead) >= 5 })

	got := effects(t, r.db)
	// A failed handler's write is rolled back; a definitive failure is
	// stored, and commits with what the handler wrote, as a stored 4xx does.
	want := map[string]int{"order-1": 1, "order-2": 1, "order-4": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("effects %v, want %v", got, want)
	}
	for k, n := range map[string]int{"order-1": 1, "order-2": 3, "order-3": 3, "order-4": 1} {
		if got := c.get(k); got != n {
			t.Errorf("%s's handler ran %d times, want %d", k, got, n)
		}
	}
	if dead, want := r.dead(), []string{"m-4", "m-5", "m-6", "m-7", "m-8"}; fmt.Sprint(dead) !=
		fmt.Sprint(want) {
		t.Errorf("dead letters %v, want %v (exhausted, definitive, no key, key reused, "+
			"definitive replayed)", dead, want)
	}
}

// TestDefaultKeyAndMissingID: without a key function the key is the
// message-id property, and a message without one is dead-lettered, never
// run; a message id delivered again after its completion is acknowledged
// without running.
func TestDefaultKeyAndMissingID(t *testing.T) {
	r := newRig(t)
	var c calls
	h, err := amqpconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			c.add(string(d.Body))
			return effect(ctx, string(d.Body))
		}, amqpconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("pay-1", "a")
	r.publish("", "b")
	r.settled(func() bool { return ready(t, r.ch, r.q.dead) == 1 && c.get("a") == 1 })
	r.publish("pay-1", "a") // later: RabbitMQ de-duplicates nothing
	r.settled(func() bool { return true })
	if c.get("a") != 1 || c.get("b") != 0 || effects(t, r.db)["a"] != 1 {
		t.Errorf("runs: a %d (want 1), b %d (want 0: no key)", c.get("a"), c.get("b"))
	}
	if dead := r.dead(); len(dead) != 1 || dead[0] != "" {
		t.Errorf("dead letters %q, want the message without an id", dead)
	}
}

// TestInProgressWaitsForTheLease: a duplicate delivered while the first
// execution runs comes back through the delay queue when that execution's
// lease ends, not in a requeue loop, and is then acknowledged without
// running.
func TestInProgressWaitsForTheLease(t *testing.T) {
	r := newRig(t)
	var c calls
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h, err := amqpconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			c.add("order-1")
			started <- struct{}{}
			<-release
			return effect(ctx, "order-1")
		}, amqpconsumer.WithKey(businessKey),
		amqpconsumer.WithMaxAttempts(1), amqpconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 2)
	r.publish("m-1", "pay", "Business-Key", "order-1")
	<-started
	r.publish("m-2", "pay", "Business-Key", "order-1")
	time.Sleep(2500 * time.Millisecond) // the lease (1 s) heartbeated: 2 or 3 remainders
	close(release)
	r.settled(func() bool { return effects(t, r.db)["order-1"] == 1 })
	if n := c.get("order-1"); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
	// One refusal per lease remainder (about 1/3 to 1 s): a requeue loop
	// would refuse thousands of times. Waiting is no failed attempt: with
	// WithMaxAttempts(1) the duplicate is still not dead-lettered.
	if n := r.refuse.Load(); n < 1 || n > 8 {
		t.Errorf("the duplicate was refused %d times in 2.5 s, want 1 to 8", n)
	}
	if dead := r.dead(); len(dead) != 0 {
		t.Errorf("dead letters %v, want none", dead)
	}
}

// TestTenant: the tenant taken from the message is part of the scope: the
// same key under two tenants is two calls; a message without a tenant is
// dead-lettered.
func TestTenant(t *testing.T) {
	r := newRig(t)
	var c calls
	h, err := amqpconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			c.add(run.Scope.Principal)
			return nil
		},
		amqpconsumer.WithKey(businessKey), amqpconsumer.WithPrincipal("payments"),
		amqpconsumer.WithTenant(func(d amqp.Delivery) (string, error) {
			t, _ := d.Headers["Tenant"].(string)
			return t, nil
		}), amqpconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("m-1", "pay", "Business-Key", "k", "Tenant", "acme")
	r.publish("m-2", "pay", "Business-Key", "k", "Tenant", "globex")
	r.publish("m-3", "pay", "Business-Key", "k", "Tenant", "acme")
	r.publish("m-4", "pay", "Business-Key", "k")
	r.settled(func() bool { return ready(t, r.ch, r.q.dead) == 1 })
	if c.get("payments/acme") != 1 || c.get("payments/globex") != 1 {
		t.Errorf("runs by principal %v, want payments/acme and payments/globex once each", c.n)
	}
	if dead := r.dead(); fmt.Sprint(dead) != "[m-4]" {
		t.Errorf("dead letters %v, want [m-4]", dead)
	}
}

// TestPublishStableMessageID: a handler that publishes and then fails is
// resumed after the published step when its message comes back: the
// broker gets the message once, under the step's downstream key.
func TestPublishStableMessageID(t *testing.T) {
	r := newRig(t)
	receipts := r.q.name + ".receipts"
	if _, err := r.ch.QueueDeclare(receipts, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	pubCh, err := r.conn.Channel()
	if err == nil {
		err = pubCh.Confirm(false)
	}
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var ids []string
	h, err := amqpconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			err := amqpconsumer.Publish(ctx, pubCh, run, "receipt", "", receipts,
				amqp.Publishing{Body: []byte("receipt of " + string(d.Body))})
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			ids = append(ids, run.DownstreamKey("receipt"))
			if len(ids) == 1 {
				return errors.New("failed after publishing")
			}
			return nil
		}, amqpconsumer.WithBackoff(10*time.Millisecond, 10*time.Millisecond),
		amqpconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("pay-1", "order-1")
	r.settled(func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ids) == 2
	})
	mu.Lock()
	defer mu.Unlock()
	if ids[0] != ids[1] || strings.Contains(ids[0], "pay-1") {
		t.Errorf("downstream keys %v, want one, without the key", ids)
	}
	var got []string
	for {
		d, ok, err := r.ch.Get(receipts, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		got = append(got, d.MessageId)
	}
	if len(got) != 1 || got[0] != ids[0] {
		t.Errorf("receipts published with ids %v, want one, %s", got, ids[0])
	}
}

// TestNewRefuses: invalid configurations are refused with
// ErrInvalidConfig.
func TestNewRefuses(t *testing.T) {
	mw := idempotency.New(nil, idempotency.WithLogger(nil))
	fn := func(context.Context, *idempotency.Run, amqp.Delivery) error { return nil }
	for name, f := range map[string]func() (*amqpconsumer.Handler, error){
		"nil middleware": func() (*amqpconsumer.Handler, error) {
			return amqpconsumer.New(nil, "op", fn)
		},
		"nil func": func() (*amqpconsumer.Handler, error) { return amqpconsumer.New(mw, "op", nil) },
		"empty operation": func() (*amqpconsumer.Handler, error) {
			return amqpconsumer.New(mw, "", fn)
		},
	} {
		if _, err := f(); !errors.Is(err, amqpconsumer.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
	h, err := amqpconsumer.New(mw, "op", fn)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Consume(t.Context(), nil, ""); !errors.Is(err, amqpconsumer.ErrInvalidConfig) {
		t.Errorf("Consume of no queue: %v, want ErrInvalidConfig", err)
	}
}
