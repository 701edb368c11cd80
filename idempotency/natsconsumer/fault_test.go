package natsconsumer_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
	"github.com/saferetry/saferetry/keygen"
)

// order is the body of a test message: one charge of an order.
type order struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
	Slow   bool   `json:"slow,omitempty"`  // the handler announces itself and lingers: a kill lands
	Flaky  bool   `json:"flaky,omitempty"` // fails on its first two deliveries
	Fail   bool   `json:"fail,omitempty"`  // always fails: dead-lettered when attempts run out
}

// orderKey is the consumers' key function: event-derived, so that an
// order published again under a new message id is the same call.
func orderKey(m natsconsumer.Message) (string, error) {
	var o order
	if err := json.Unmarshal(m.Data, &o); err != nil {
		return "", err
	}
	if o.Order == "" {
		return "", errors.New("no order")
	}
	return keygen.Event("charge", o.Order), nil
}

// charge is the consumers' handler: it writes the charge in the
// transaction of the stored outcome.
func charge(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
	var o order
	if err := json.Unmarshal(m.Data, &o); err != nil {
		return err
	}
	switch {
	case o.Amount < 0:
		return fmt.Errorf("a negative amount: %w", idempotency.ErrDefinitive)
	case o.Fail:
		return errors.New("the card network refuses this order for now")
	case o.Flaky && m.Delivered <= 2:
		return errors.New("the card network timed out")
	case o.Slow:
		fmt.Printf("BUSY %s\n", o.Order)
		time.Sleep(400 * time.Millisecond)
	}
	return effect(ctx, o.Order)
}

// The child consumer process: the test binary run again with
// NATSCONSUMER_CHILD=1. It consumes until its standard input closes.
const childEnv = "NATSCONSUMER_CHILD"

func childMain() int {
	ctx, cancel := context.WithCancel(context.Background())
	go func() { // the parent closes our stdin to stop us
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	d := testDB{driver: os.Getenv("CHILD_DB_DRIVER"), dsn: os.Getenv("CHILD_DB_DSN")}
	d.dialect = dialectOf(d.driver)
	db, store, err := d.openStore(ctx, false)
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	var slow sync.Map // keys of slow orders: announce their commit too
	mw := idempotency.New(store, idempotency.WithLogger(nil),
		idempotency.WithLease(2*time.Second),
		idempotency.WithObserver(idempotency.Observer{
			Executed: func(ctx context.Context, e idempotency.Event) {
				if o, ok := slow.Load(e.Scope.Key); ok && e.Outcome == idempotency.OutcomeCompleted {
					fmt.Printf("COMMITTED %s\n", o)
					time.Sleep(400 * time.Millisecond)
				}
			}}))
	nc, err := nats.Connect(os.Getenv("CHILD_NATS_URL"), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { fmt.Println("CONNECTED") }))
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	fmt.Println("CONNECTED")
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	h, err := natsconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			var o order
			if json.Unmarshal(m.Data, &o) == nil && o.Slow {
				slow.Store(run.Scope.Key, o.Order)
			}
			return charge(ctx, run, m)
		},
		natsconsumer.WithKey(orderKey),
		natsconsumer.WithMaxAttempts(4), natsconsumer.WithBackoff(10*time.Millisecond,
			100*time.Millisecond),
		natsconsumer.WithDeadLetter(js, os.Getenv("CHILD_DL_SUBJECT")),
		natsconsumer.WithLogger(slog.New(slog.NewTextHandler(os.Stderr,
			&slog.HandlerOptions{Level: slog.LevelWarn}))))
	if err != nil {
		return fail(err)
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				cons, err := js.Consumer(ctx, os.Getenv("CHILD_STREAM"), "workers")
				if err == nil {
					err = h.Consume(ctx, cons)
				}
				if err != nil && ctx.Err() == nil {
					fmt.Fprintln(os.Stderr, "child: consume:", err)
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	return 0
}

// child is a running consumer process.
type child struct {
	connects atomic.Int64 // connections made to the broker
	cmd      *exec.Cmd
	stdin    io.Closer
	stderr   *bytes.Buffer
	done     chan struct{}
}

// fleet runs the consumer processes and SIGKILLs them on their markers.
type fleet struct {
	t          *testing.T
	env        []string
	mu         sync.Mutex
	kids       []*child
	kills      int // done
	toKill     int // asked for
	markers    chan marker
	logs       bytes.Buffer // the stderr of every child that ended
	reconnects atomic.Int64
}

type marker struct {
	kid  *child
	kind string // BUSY: the handler runs; COMMITTED: stored, not yet acknowledged
}

func (f *fleet) start() {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), f.env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	c := &child{cmd: cmd, stdin: stdin, stderr: &bytes.Buffer{}, done: make(chan struct{})}
	cmd.Stderr = c.stderr
	if err := cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			kind, _, _ := strings.Cut(sc.Text(), " ")
			if kind == "CONNECTED" {
				if c.connects.Add(1) > 1 {
					f.reconnects.Add(1)
				}
				continue
			}
			select {
			case f.markers <- marker{kid: c, kind: kind}:
			default:
			}
		}
		_ = cmd.Wait()
		close(c.done)
	}()
	f.mu.Lock()
	f.kids = append(f.kids, c)
	f.mu.Unlock()
}

// killer SIGKILLs a child on each marker until toKill are dead, the odd
// ones while the handler runs, the even ones after the commit and before
// the acknowledgement, and starts a new child in its place.
func (f *fleet) killer(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-f.markers:
			f.mu.Lock()
			want := "BUSY"
			if f.kills%2 == 1 {
				want = "COMMITTED"
			}
			if f.kills >= f.toKill || m.kind != want {
				f.mu.Unlock()
				continue
			}
			f.kills++
			f.mu.Unlock()
			_ = m.kid.cmd.Process.Signal(syscall.SIGKILL)
			<-m.kid.done
			f.start()
		}
	}
}

// connected returns the children connected now, with the count of their
// connections.
func (f *fleet) connected() map[*child]int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[*child]int64{}
	for _, c := range f.kids {
		if n := c.connects.Load(); n > 0 {
			out[c] = n
		}
	}
	return out
}

// reconnectedSince reports whether every child of kids connected again
// since, or has ended (killed).
func (f *fleet) reconnectedSince(kids map[*child]int64) bool {
	for c, n := range kids {
		select {
		case <-c.done:
		default:
			if c.connects.Load() <= n {
				return false
			}
		}
	}
	return true
}

// stop closes every child's stdin and waits for it to end.
func (f *fleet) stop() {
	f.mu.Lock()
	kids := f.kids
	f.mu.Unlock()
	for _, c := range kids {
		if f.t.Failed() {
			_ = c.cmd.Process.Signal(syscall.SIGQUIT) // its goroutines, to its stderr
		}
		_ = c.stdin.Close()
	}
	for _, c := range kids {
		select {
		case <-c.done:
		case <-time.After(20 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		f.logs.Write(c.stderr.Bytes())
	}
}

// messageCount is the size of the fault run: SAFERETRY_BROKER_MESSAGES, or
// 10,000.
func messageCount(t *testing.T) int {
	if s := os.Getenv("SAFERETRY_BROKER_MESSAGES"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1000 {
			t.Fatalf("SAFERETRY_BROKER_MESSAGES=%q: want a count of at least 1000", s)
		}
		return n
	}
	return 10000
}

// The kinds of business item in the fault run.
const (
	normal = iota
	poison
	definitive
	exhausted
)

// item is one business item of the run, and the messages that carry it.
type item struct {
	order order
	kind  int
	body  []byte
}

// TestFaultRun publishes messageCount messages, 30% of them duplicates
// (half the same order under a new message id, half the same message id
// again), to 4 consumer processes through an in-process toxiproxy, SIGKILLs
// a consumer mid-message 5 times and cuts every broker connection once, and
// checks that every order took effect once, that nothing is left in
// progress or unacknowledged, and that every poison, definitive and
// exhausted message is in the dead-letter stream, each once.
func TestFaultRun(t *testing.T) {
	u := natsURL(t)
	n := messageCount(t)
	_, js := connect(t, u)
	s := newStream(t, js, 0)
	s.consumer(t, js, 3*time.Second)
	db := newDB(t, os.Getenv("SAFERETRY_PG_DSN") != "")
	ctx := t.Context()
	sqlDB, store, err := db.openStore(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	defer sqlDB.Close()
	proxy := startProxy(t, hostPort(t, u))

	// The items: 70% of the messages; among them poison, definitive,
	// exhausted, flaky and slow ones.
	rnd := rand.New(rand.NewPCG(uint64(n), 39))
	unique := n * 7 / 10
	items := make([]item, unique)
	for i := range items {
		it := &items[i]
		it.order = order{Order: fmt.Sprintf("o-%06d", i), Amount: 100 + i%50}
		switch {
		case i < n/200:
			it.kind = poison
		case i < n/200+n*3/1000:
			it.kind, it.order.Amount = definitive, -1
		case i < n/200+n*4/1000:
			it.kind, it.order.Fail = exhausted, true
		case i < n/200+n*7/1000:
			it.order.Flaky = true
		case i < n/200+n*7/1000+20:
			it.order.Slow = true
		}
		it.body, _ = json.Marshal(it.order)
		if it.kind == poison {
			it.body = append([]byte("\x00not json: "), it.body...)
		}
	}
	type pub struct {
		item  int
		msgID string
	}
	pubs := make([]pub, 0, n)
	for i := range items {
		pubs = append(pubs, pub{item: i, msgID: fmt.Sprintf("m-%06d", i)})
	}
	dupNewID := (n - unique) / 2
	for k := 0; len(pubs) < n; k++ {
		i := rnd.IntN(unique)
		if k < dupNewID {
			pubs = append(pubs, pub{item: i, msgID: fmt.Sprintf("m-%06d-again-%d", i, k)})
		} else {
			pubs = append(pubs, pub{item: i, msgID: fmt.Sprintf("m-%06d", i)})
		}
	}
	rnd.Shuffle(len(pubs), func(a, b int) { pubs[a], pubs[b] = pubs[b], pubs[a] })

	f := &fleet{t: t, toKill: 5, markers: make(chan marker, 16), env: []string{
		childEnv + "=1", "CHILD_NATS_URL=nats://" + proxy.Listen, "CHILD_STREAM=" + s.name,
		"CHILD_DL_SUBJECT=" + s.dlSubject, "CHILD_DB_DRIVER=" + db.driver,
		"CHILD_DB_DSN=" + db.dsn,
	}}
	killCtx, stopKiller := context.WithCancel(ctx)
	for range 4 {
		f.start()
	}
	go f.killer(killCtx)
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			stopKiller()
			f.stop()
		}
	}
	defer func() {
		stop()
		if t.Failed() {
			t.Logf("the consumers' logs:\n%s", tail(f.logs.String(), 400))
		}
	}()

	// Publish; record every message's stream sequence.
	futures := make([]jetstream.PubAckFuture, len(pubs))
	for i, p := range pubs {
		m := &nats.Msg{Subject: s.subject, Data: items[p.item].body, Header: nats.Header{}}
		m.Header.Set(jetstream.MsgIDHeader, p.msgID)
		if futures[i], err = js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		t.Fatal("the publishes were not acknowledged within a minute")
	}
	wantDead := map[uint64]string{} // stream sequence -> reason
	brokerDropped := 0
	for i, fu := range futures {
		var ack *jetstream.PubAck
		select {
		case ack = <-fu.Ok():
		case err := <-fu.Err():
			t.Fatalf("publish %d: %v", i, err)
		}
		if ack.Duplicate {
			brokerDropped++
			continue
		}
		switch items[pubs[i].item].kind {
		case poison:
			wantDead[ack.Sequence] = "key_invalid"
		case definitive:
			wantDead[ack.Sequence] = "definitive"
		case exhausted:
			wantDead[ack.Sequence] = "attempts_exhausted"
		}
	}
	wantEffects := map[string]int{}
	for _, it := range items {
		if it.kind == normal {
			wantEffects[it.order.Order] = 1
		}
	}

	// Cut every consumer's connection once, half way.
	eventually(t, 3*time.Minute, "half the effects", func() bool {
		return len(effects(t, sqlDB)) >= len(wantEffects)/2
	})
	cutAt := f.connected()
	proxy.Stop()
	time.Sleep(time.Second)
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "every consumer connected at the cut reconnected", func() bool {
		return f.reconnectedSince(cutAt)
	})

	if !within(4*time.Minute, func() bool {
		pending, ackPending := s.pending(t, js)
		return pending == 0 && ackPending == 0 && len(effects(t, sqlDB)) == len(wantEffects)
	}) {
		t.Errorf("after 4m: not yet every message settled")
	}
	stop()

	got := effects(t, sqlDB)
	total := 0
	for k, c := range got {
		total += c
		if wantEffects[k] != c {
			t.Errorf("order %s took effect %d times, want %d", k, c, wantEffects[k])
		}
	}
	for k := range wantEffects {
		if got[k] == 0 {
			t.Errorf("order %s was lost: no effect", k)
		}
	}
	open, err := store.Abandoned(ctx, time.Now().Add(time.Hour), 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(open) != 0 {
		t.Errorf("%d records left in progress", len(open))
	}
	dead := map[string]int{}
	seen := map[uint64]bool{}
	for _, m := range s.deadLetters(t, js) {
		seq, _ := strconv.ParseUint(m.Headers().Get("Saferetry-Sequence"), 10, 64)
		reason := m.Headers().Get("Saferetry-Reason")
		dead[reason]++
		switch {
		case seen[seq]:
			t.Errorf("stream sequence %d dead-lettered twice", seq)
		case wantDead[seq] != reason:
			t.Errorf("stream sequence %d dead-lettered as %q, want %q", seq, reason,
				wantDead[seq])
		}
		seen[seq] = true
	}
	for seq, reason := range wantDead {
		if !seen[seq] {
			t.Errorf("stream sequence %d (%s) is not in the dead-letter stream", seq, reason)
		}
	}
	if f.kills != 5 {
		t.Errorf("%d consumers killed mid-message, want 5", f.kills)
	}
	t.Logf("fault run (%s store): %d messages published (%d orders, %d again under a new "+
		"message id, %d again under the same id, of which JetStream dropped %d within its "+
		"window); 4 consumer processes, %d SIGKILLed mid-message, every connection cut once (%d reconnects); "+
		"effects %d = orders that should take effect %d; dead letters %v; left in progress %d",
		db.driver, n, unique, dupNewID, n-unique-dupNewID, brokerDropped, f.kills, f.reconnects.Load(), total,
		len(wantEffects), dead, len(open))
}

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	return strings.Join(l[max(len(l)-lines, 0):], "\n")
}
