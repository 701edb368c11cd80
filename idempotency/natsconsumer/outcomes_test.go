package natsconsumer_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// rig is one stream, a SQLite store and Handlers consuming in this process.
type rig struct {
	t      *testing.T
	js     jetstream.JetStream
	s      testStream
	db     *sql.DB
	store  *sqlstore.Store
	mw     *idempotency.Middleware
	refuse atomic.Int64 // in-progress refusals seen by the Middleware
}

func newRig(t *testing.T, dup time.Duration) *rig {
	u := natsURL(t)
	r := &rig{t: t}
	_, r.js = connect(t, u)
	r.s = newStream(t, r.js, dup)
	r.s.consumer(t, r.js, 2*time.Second)
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

// consume runs h.Consume in n goroutines until the test ends.
func (r *rig) consume(h *natsconsumer.Handler, n int) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cons, err := r.js.Consumer(ctx, r.s.name, "workers")
			if err != nil {
				r.t.Error(err)
				return
			}
			if err := h.Consume(ctx, cons); err != nil {
				r.t.Error(err)
			}
		}()
	}
	r.t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

// publish publishes data under msgID ("" for none) with headers kv.
func (r *rig) publish(msgID, data string, kv ...string) *jetstream.PubAck {
	m := &nats.Msg{Subject: r.s.subject, Data: []byte(data), Header: nats.Header{}}
	if msgID != "" {
		m.Header.Set(jetstream.MsgIDHeader, msgID)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Header.Set(kv[i], kv[i+1])
	}
	ack, err := r.js.PublishMsg(context.Background(), m)
	if err != nil {
		r.t.Fatal(err)
	}
	return ack
}

// settled waits until the consumer has nothing pending or unacknowledged.
func (r *rig) settled() {
	r.t.Helper()
	eventually(r.t, 30*time.Second, "the consumer settled", func() bool {
		p, a := r.s.pending(r.t, r.js)
		return p == 0 && a == 0
	})
}

// deadReasons returns the dead-letter stream's reasons by original
// sequence.
func (r *rig) deadReasons() map[uint64]string {
	out := map[uint64]string{}
	for _, m := range r.s.deadLetters(r.t, r.js) {
		var seq uint64
		_, _ = fmt.Sscan(m.Headers().Get("Saferetry-Sequence"), &seq)
		out[seq] = m.Headers().Get("Saferetry-Reason")
	}
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
func businessKey(m natsconsumer.Message) (string, error) {
	if k := m.Header.Get("Business-Key"); k != "" {
		return k, nil
	}
	return "", errors.New("no Business-Key header")
}

// TestOutcomes checks what each outcome does to its message, on a real
// JetStream: a fresh message runs, is stored and acknowledged; its
// duplicate under a new message id is acknowledged without running; a
// failure that wrote first is rolled back and redelivered with backoff; a
// failure on every delivery, a definitive failure and poison messages are
// dead-lettered; a definitive failure is replayed to its duplicate.
func TestOutcomes(t *testing.T) {
	r := newRig(t, 0)
	var c calls
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			k := m.Header.Get("Business-Key")
			n := c.add(k)
			if err := effect(ctx, k); err != nil {
				return err
			}
			switch body := string(m.Data); {
			case body == "decline":
				return fmt.Errorf("card declined: %w", idempotency.ErrDefinitive)
			case body == "fail":
				return errors.New("the network is down")
			case body == "flaky" && n <= 2:
				return errors.New("timed out") // after the write: rolled back
			}
			return nil
		},
		natsconsumer.WithKey(businessKey), natsconsumer.WithMaxAttempts(3),
		natsconsumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond),
		natsconsumer.WithDeadLetter(r.js, r.s.dlSubject), natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 2)

	ok := r.publish("m-1", "pay", "Business-Key", "order-1")
	dupNewID := r.publish("m-2", "pay", "Business-Key", "order-1")
	flaky := r.publish("m-3", "flaky", "Business-Key", "order-2")
	fail := r.publish("m-4", "fail", "Business-Key", "order-3")
	decline := r.publish("m-5", "decline", "Business-Key", "order-4")
	noKey := r.publish("m-6", "pay")
	reused := r.publish("m-7", "pay more", "Business-Key", "order-1")
	r.settled()
	declineAgain := r.publish("m-8", "decline", "Business-Key", "order-4")
	r.settled()

	got := effects(t, r.db)
	// A failed handler's write is rolled back; a definitive failure is
	// stored, and commits with what the handler wrote, as a stored 4xx does.
	want := map[string]int{"order-1": 1, "order-2": 1, "order-4": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("effects %v, want %v", got, want)
	}
	if n := c.get("order-1"); n != 1 {
		t.Errorf("order-1's handler ran %d times, want 1 (its duplicates %d and %d replayed "+
			"or refused)", n, dupNewID.Sequence, reused.Sequence)
	}
	if n := c.get("order-2"); n != 3 {
		t.Errorf("the flaky handler ran %d times, want 3", n)
	}
	if n := c.get("order-3"); n != 3 {
		t.Errorf("the failing handler ran %d times, want 3 (WithMaxAttempts)", n)
	}
	if n := c.get("order-4"); n != 1 {
		t.Errorf("the declined handler ran %d times, want 1 (its verdict is stored)", n)
	}
	dead := r.deadReasons()
	wantDead := map[uint64]string{fail.Sequence: "attempts_exhausted",
		decline.Sequence: "definitive", declineAgain.Sequence: "definitive",
		noKey.Sequence: "key_invalid", reused.Sequence: "key_reused"}
	if fmt.Sprint(dead) != fmt.Sprint(wantDead) {
		t.Errorf("dead letters %v, want %v", dead, wantDead)
	}
	_, _ = ok, flaky
	for _, m := range r.s.deadLetters(t, r.js) {
		if m.Headers().Get("Saferetry-Reason") == "definitive" &&
			!strings.Contains(m.Headers().Get("Saferetry-Error"), "card declined") {
			t.Errorf("the definitive dead letter's error is %q",
				m.Headers().Get("Saferetry-Error"))
		}
	}
}

// TestDefaultKeyAndMissingID: without a key function the key is the
// Nats-Msg-Id, and a message without one is dead-lettered, never run.
func TestDefaultKeyAndMissingID(t *testing.T) {
	r := newRig(t, 0)
	var c calls
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			c.add(string(m.Data))
			return effect(ctx, string(m.Data))
		}, natsconsumer.WithDeadLetter(r.js, r.s.dlSubject), natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("pay-1", "a")
	missing := r.publish("", "b")
	r.settled()
	if c.get("a") != 1 || c.get("b") != 0 {
		t.Errorf("runs: a %d (want 1), b %d (want 0: no key)", c.get("a"), c.get("b"))
	}
	if got := r.deadReasons(); got[missing.Sequence] != "key_missing" || len(got) != 1 {
		t.Errorf("dead letters %v, want only %d: key_missing", got, missing.Sequence)
	}
}

// TestRedeliveryAfterDuplicateWindow: JetStream drops a re-published
// Nats-Msg-Id only within the stream's duplicate window; after it, the
// message reaches the consumer again, and the store still de-duplicates it.
func TestRedeliveryAfterDuplicateWindow(t *testing.T) {
	const window = 500 * time.Millisecond
	r := newRig(t, window)
	var c calls
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			c.add("pay-1")
			return effect(ctx, "pay-1")
		}, natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	first := r.publish("pay-1", "100 EUR")
	if again := r.publish("pay-1", "100 EUR"); !again.Duplicate {
		t.Fatal("JetStream did not drop the copy within its window")
	}
	r.settled()
	time.Sleep(window + 300*time.Millisecond)
	late := r.publish("pay-1", "100 EUR")
	if late.Duplicate || late.Sequence == first.Sequence {
		t.Fatal("JetStream dropped the copy after its window: the test proves nothing")
	}
	r.settled()
	if n, e := c.get("pay-1"), effects(t, r.db)["pay-1"]; n != 1 || e != 1 {
		t.Errorf("after the window: the handler ran %d times and took effect %d times, "+
			"want 1 and 1", n, e)
	}
}

// TestInProgressWaitsForTheLease: a duplicate delivered while the first
// execution runs is redelivered when that execution's lease ends, not in a
// hot loop, and is then acknowledged without running.
func TestInProgressWaitsForTheLease(t *testing.T) {
	r := newRig(t, 0)
	var c calls
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			c.add("order-1")
			started <- struct{}{}
			<-release
			return effect(ctx, "order-1")
		}, natsconsumer.WithKey(businessKey),
		natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 2)
	r.publish("m-1", "pay", "Business-Key", "order-1")
	<-started
	r.publish("m-2", "pay", "Business-Key", "order-1")
	time.Sleep(2500 * time.Millisecond) // the lease (1 s) heartbeated: 2 or 3 remainders
	close(release)
	r.settled()
	if n := c.get("order-1"); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
	// One refusal per lease remainder (about 1/3 to 1 s): a hot loop would
	// refuse thousands of times.
	if n := r.refuse.Load(); n < 1 || n > 8 {
		t.Errorf("the duplicate was refused %d times in 2.5 s, want 1 to 8", n)
	}
}

// TestTenant: the tenant taken from the message is part of the scope: the
// same key under two tenants is two calls; a message without a tenant is
// dead-lettered.
func TestTenant(t *testing.T) {
	r := newRig(t, 0)
	var c calls
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			c.add(run.Scope.Principal)
			return nil
		},
		natsconsumer.WithKey(businessKey), natsconsumer.WithPrincipal("payments"),
		natsconsumer.WithTenant(func(m natsconsumer.Message) (string, error) {
			return m.Header.Get("Tenant"), nil
		}), natsconsumer.WithDeadLetter(r.js, r.s.dlSubject), natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("m-1", "pay", "Business-Key", "k", "Tenant", "acme")
	r.publish("m-2", "pay", "Business-Key", "k", "Tenant", "globex")
	r.publish("m-3", "pay", "Business-Key", "k", "Tenant", "acme")
	none := r.publish("m-4", "pay", "Business-Key", "k")
	r.settled()
	if c.get("payments/acme") != 1 || c.get("payments/globex") != 1 {
		t.Errorf("runs by principal %v, want payments/acme and payments/globex once each", c.n)
	}
	if got := r.deadReasons(); got[none.Sequence] != "tenant_missing" || len(got) != 1 {
		t.Errorf("dead letters %v, want only %d: tenant_missing", got, none.Sequence)
	}
}

// TestPublishStableMessageID: a handler that publishes and then fails is
// resumed after the published step on its redelivery: JetStream gets the
// message once, under the step's downstream key, and the handler the same
// PubAck both times.
func TestPublishStableMessageID(t *testing.T) {
	r := newRig(t, 0)
	receipts := "saferetry." + randHex(4) + ".receipts"
	stream := "SR_RECEIPTS_" + strings.ToUpper(randHex(4))
	if _, err := r.js.CreateStream(t.Context(), jetstream.StreamConfig{
		Name: stream, Subjects: []string{receipts}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.js.DeleteStream(context.Background(), stream) })
	var mu sync.Mutex
	var seqs []uint64
	var ids []string
	h, err := natsconsumer.New(r.mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			ack, err := natsconsumer.Publish(ctx, r.js, run, "receipt",
				&nats.Msg{Subject: receipts, Data: []byte("receipt of " + string(m.Data))})
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			seqs = append(seqs, ack.Sequence)
			ids = append(ids, run.DownstreamKey("receipt"))
			if len(seqs) == 1 {
				return errors.New("failed after publishing")
			}
			return nil
		}, natsconsumer.WithBackoff(10*time.Millisecond, 10*time.Millisecond),
		natsconsumer.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	r.consume(h, 1)
	r.publish("pay-1", "order-1")
	r.settled()
	mu.Lock()
	defer mu.Unlock()
	if len(seqs) != 2 || seqs[0] != seqs[1] || ids[0] != ids[1] {
		t.Errorf("publishes: sequences %v, ids %v; want one message under one id", seqs, ids)
	}
	st, err := r.js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetMsg(t.Context(), 1)
	switch {
	case err != nil:
		t.Fatal(err)
	case st.CachedInfo().State.Msgs != 1:
		t.Errorf("%d receipts published, want 1", st.CachedInfo().State.Msgs)
	case len(ids) > 0 && m.Header.Get(jetstream.MsgIDHeader) != ids[0]:
		t.Errorf("the receipt's Nats-Msg-Id is %q, want the downstream key %q",
			m.Header.Get(jetstream.MsgIDHeader), ids[0])
	}
	for _, id := range ids {
		if strings.Contains(id, "pay-1") {
			t.Errorf("the downstream message id %q carries the key", id)
		}
	}
}

// TestNewRefuses: invalid configurations are refused with
// ErrInvalidConfig.
func TestNewRefuses(t *testing.T) {
	mw := idempotency.New(nil, idempotency.WithLogger(nil))
	fn := func(context.Context, *idempotency.Run, natsconsumer.Message) error { return nil }
	for name, f := range map[string]func() (*natsconsumer.Handler, error){
		"nil middleware": func() (*natsconsumer.Handler, error) {
			return natsconsumer.New(nil, "op", fn)
		},
		"nil func": func() (*natsconsumer.Handler, error) { return natsconsumer.New(mw, "op", nil) },
		"empty operation": func() (*natsconsumer.Handler, error) {
			return natsconsumer.New(mw, "", fn)
		},
		"dead letter without subject": func() (*natsconsumer.Handler, error) {
			return natsconsumer.New(mw, "op", fn, natsconsumer.WithDeadLetter(nil, "x"))
		},
	} {
		if _, err := f(); !errors.Is(err, natsconsumer.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
}
