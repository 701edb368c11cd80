// Command consumer is saferetry's message-consumer demo: an embedded NATS
// JetStream server and a SQLite file, no setup. It publishes orders (30% of
// them again: half under a new message id, as a producer that retried after
// a timeout does, half under the same id), and two consumers of the same
// stream charge them: one through the natsconsumer guard, one without it
// (charge, then acknowledge). Each runs as two worker processes, and one of
// them is SIGKILLed mid-message and restarted a few times. At the end it
// counts the charges: the guarded consumer charged every order once; the
// other shows what the guard prevents. Exit status: 0 pass, 1 a guarded
// order charged twice or not at all, 2 error.
//
//	go run ./examples/consumer
//	go run ./examples/consumer -messages 10000 -kills 5
package main

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/keygen"
)

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

type config struct {
	messages, kills int
	worker          string // "guarded" or "bare": run as a worker process
	natsURL, dbPath string
}

func realMain(args []string, stdout, stderr io.Writer) int {
	var cfg config
	fs := flag.NewFlagSet("consumer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.messages, "messages", 2000,
		"messages to publish, duplicates included (at least 100)")
	fs.IntVar(&cfg.kills, "kills", 3,
		"how many times a worker of each consumer is SIGKILLed mid-message")
	fs.StringVar(&cfg.worker, "worker", "", "internal: run as a worker process of this consumer")
	fs.StringVar(&cfg.natsURL, "nats", "", "internal: the worker's NATS server")
	fs.StringVar(&cfg.dbPath, "db", "", "internal: the worker's SQLite file")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var err error
	switch {
	case cfg.worker != "":
		err = work(cfg)
	case cfg.messages < 100:
		err = errors.New("-messages: at least 100")
	default:
		var ok bool
		ok, err = demo(cfg, stdout)
		if err == nil && !ok {
			return 1
		}
	}
	if err != nil {
		fmt.Fprintln(stderr, "consumer:", err)
		return 2
	}
	return 0
}

// order is a message's body.
type order struct {
	Order string `json:"order"`
	Slow  bool   `json:"slow,omitempty"` // the worker lingers mid-message: a kill lands there
}

func demo(cfg config, out io.Writer) (bool, error) {
	dir, err := os.MkdirTemp("", "saferetry-consumer")
	if err != nil {
		return false, err
	}
	defer os.RemoveAll(dir)
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT,
		JetStream: true, StoreDir: filepath.Join(dir, "jetstream"), NoLog: true, NoSigs: true})
	if err != nil {
		return false, err
	}
	srv.Start()
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	if !srv.ReadyForConnections(10 * time.Second) {
		return false, errors.New("the embedded NATS server did not start")
	}
	cfg.natsURL, cfg.dbPath = srv.ClientURL(), filepath.Join(dir, "shop.db")
	db, store, err := openDB(cfg.dbPath)
	if err != nil {
		return false, err
	}
	defer db.Close()
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		return false, err
	}
	for _, t := range []string{"charges_guarded", "charges_bare"} {
		if _, err := db.Exec("CREATE TABLE " + t +
			" (id INTEGER PRIMARY KEY, orderid TEXT NOT NULL)"); err != nil {
			return false, err
		}
	}
	nc, err := nats.Connect(cfg.natsURL)
	if err != nil {
		return false, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false, err
	}
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS",
		Subjects: []string{"orders"}})
	if err != nil {
		return false, err
	}
	for _, c := range []string{"guarded", "bare"} {
		if _, err := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
			Durable: c, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 2 * time.Second,
			MaxDeliver: -1}); err != nil {
			return false, err
		}
	}

	orders, newID, sameID, dropped, err := publish(ctx, js, cfg.messages)
	if err != nil {
		return false, err
	}
	f := &fleet{cfg: cfg, markers: make(chan *worker, 16)}
	for _, c := range []string{"guarded", "guarded", "bare", "bare"} {
		if err := f.start(c); err != nil {
			return false, err
		}
	}
	kills := map[string]int{}
	deadline := time.Now().Add(5 * time.Minute)
	for {
		select {
		case w := <-f.markers:
			if kills[w.consumer] < cfg.kills {
				kills[w.consumer]++
				f.kill(w)
				if err := f.start(w.consumer); err != nil {
					return false, err
				}
			}
			continue
		case <-time.After(200 * time.Millisecond):
		}
		done := true
		for _, c := range []string{"guarded", "bare"} {
			cons, err := st.Consumer(ctx, c)
			if err != nil {
				return false, err
			}
			info, err := cons.Info(ctx)
			if err != nil {
				return false, err
			}
			done = done && info.NumPending == 0 && info.NumAckPending == 0
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			f.stop()
			return false, errors.New("the consumers did not finish within 5 minutes")
		}
	}
	f.stop()

	guarded, guardedOrders, _, err := count(db, "charges_guarded")
	if err != nil {
		return false, err
	}
	bare, bareOrders, bareAgain, err := count(db, "charges_bare")
	if err != nil {
		return false, err
	}
	fmt.Fprintf(out, "consumer demo: an embedded JetStream and SQLite; 2 worker processes per "+
		"consumer, one SIGKILLed mid-message %d times per consumer (then restarted)\n",
		kills["guarded"])
	fmt.Fprintf(out, "  messages published:   %d (%d orders)\n", cfg.messages, orders)
	fmt.Fprintf(out, "  duplicates:           %d again under a new message id, %d again under "+
		"the same id (JetStream's window dropped %d)\n", newID, sameID, dropped)
	fmt.Fprintf(out, "  with the guard:       %d charges for %d orders (natsconsumer: key "+
		"keygen.Event(\"charge\", order), the charge committed with the record, then DoubleAck)\n",
		guarded, orders)
	fmt.Fprintf(out, "  without the guard:    %d charges for %d orders: %d extra, %d orders "+
		"charged more than once (re-published under a new id; redelivered after a kill "+
		"between the charge and its ack, or after an ack wait ran out)\n",
		bare, bareOrders, bare-orders, bareAgain)
	ok := guarded == orders && guardedOrders == orders
	if ok {
		fmt.Fprintln(out, "PASS: every order charged once by the guarded consumer")
	} else {
		fmt.Fprintf(out, "FAIL: the guarded consumer charged %d times, %d distinct orders, "+
			"for %d orders\n", guarded, guardedOrders, orders)
	}
	return ok, nil
}

// publish publishes n messages: 70% orders, 15% an order again under a new
// message id, 15% a message again under its id. It returns the orders, the
// duplicates of each kind, and how many JetStream dropped in its window.
func publish(ctx context.Context, js jetstream.JetStream, n int) (orders, newID, sameID,
	dropped int, err error) {
	orders = n * 7 / 10
	newID = (n - orders) / 2
	sameID = n - orders - newID
	send := func(id string, i int) error {
		body, _ := json.Marshal(order{Order: fmt.Sprintf("order-%05d", i), Slow: i%97 == 13})
		m := nats.NewMsg("orders")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = body
		ack, err := js.PublishMsg(ctx, m)
		if err == nil && ack.Duplicate {
			dropped++
		}
		return err
	}
	for i := range orders {
		if err = send(fmt.Sprintf("msg-%05d", i), i); err != nil {
			return
		}
		switch {
		case i < newID:
			err = send(fmt.Sprintf("msg-%05d-retried", i), i) // a producer's retry
		case i < newID+sameID:
			err = send(fmt.Sprintf("msg-%05d", i), i)
		}
		if err != nil {
			return
		}
	}
	return
}

// count returns a charges table's rows, the orders charged, and the
// orders charged more than once.
func count(db *sql.DB, table string) (rows, orders, again int, err error) {
	err = db.QueryRow("SELECT count(*), count(DISTINCT orderid) FROM "+table).Scan(&rows,
		&orders)
	if err == nil {
		err = db.QueryRow("SELECT count(*) FROM (SELECT orderid FROM " + table +
			" GROUP BY orderid HAVING count(*) > 1)").Scan(&again)
	}
	return
}

func openDB(path string) (*sql.DB, *sqlstore.Store, error) {
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	if err != nil {
		return nil, nil, err
	}
	store, err := sqlstore.Open(db, sqlstore.SQLite)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	return db, store, nil
}

// fleet runs the worker processes.
type fleet struct {
	cfg     config
	mu      sync.Mutex
	workers []*worker
	markers chan *worker // a worker announced a message it lingers on
}

type worker struct {
	consumer string
	cmd      *exec.Cmd
	stdin    io.Closer
	done     chan struct{}
}

func (f *fleet) start(consumer string) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, "-worker", consumer, "-nats", f.cfg.natsURL, "-db", f.cfg.dbPath)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	w := &worker{consumer: consumer, cmd: cmd, stdin: stdin, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "BUSY") {
				select {
				case f.markers <- w:
				default:
				}
			}
		}
		_ = cmd.Wait()
		close(w.done)
	}()
	f.mu.Lock()
	f.workers = append(f.workers, w)
	f.mu.Unlock()
	return nil
}

func (f *fleet) kill(w *worker) {
	_ = w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
}

// stop closes every worker's stdin, which ends it, and waits.
func (f *fleet) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, w := range f.workers {
		_ = w.stdin.Close()
	}
	for _, w := range f.workers {
		select {
		case <-w.done:
		case <-time.After(20 * time.Second):
			f.kill(w)
		}
	}
}

// work is a worker process: it consumes until its stdin closes.
func work(cfg config) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	db, store, err := openDB(cfg.dbPath)
	if err != nil {
		return err
	}
	defer db.Close()
	nc, err := nats.Connect(cfg.natsURL, nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cons, err := js.Consumer(ctx, "ORDERS", cfg.worker)
	if err != nil {
		return err
	}
	if cfg.worker == "bare" {
		return bare(ctx, db, cons)
	}
	mw := idempotency.New(store, idempotency.WithLogger(nil), idempotency.WithLease(time.Second))
	h, err := natsconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			var o order
			if err := json.Unmarshal(m.Data, &o); err != nil {
				return err
			}
			tx, ok := sqlstore.Tx(ctx) // commits with the record, or not at all
			if !ok {
				return errors.New("no transaction")
			}
			if _, err := tx.ExecContext(ctx, "INSERT INTO charges_guarded (orderid) VALUES (?)",
				o.Order); err != nil {
				return err
			}
			linger(o)
			return nil
		},
		natsconsumer.WithKey(func(m natsconsumer.Message) (string, error) {
			var o order
			if err := json.Unmarshal(m.Data, &o); err != nil {
				return "", err
			}
			return keygen.Event("charge", o.Order), nil
		}),
		natsconsumer.WithLogger(nil))
	if err != nil {
		return err
	}
	return h.Consume(ctx, cons)
}

// bare is the consumer without the guard: charge, then acknowledge.
func bare(ctx context.Context, db *sql.DB, cons jetstream.Consumer) error {
	it, err := cons.Messages(jetstream.PullMaxMessages(16)) // as natsconsumer pulls
	if err != nil {
		return err
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		var o order
		if err := json.Unmarshal(m.Data(), &o); err != nil {
			_ = m.Term()
			continue
		}
		if _, err := db.ExecContext(ctx, "INSERT INTO charges_bare (orderid) VALUES (?)",
			o.Order); err != nil {
			_ = m.Nak()
			continue
		}
		linger(o)
		_ = m.DoubleAck(ctx)
	}
}

// linger announces a slow order and waits a little, so that a kill lands
// mid-message.
func linger(o order) {
	if o.Slow {
		fmt.Println("BUSY", o.Order)
		time.Sleep(300 * time.Millisecond)
	}
}
