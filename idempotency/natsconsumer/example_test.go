package natsconsumer_test

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
	"github.com/saferetry/saferetry/keygen"
)

// An order's charge is published twice under two message ids (a producer
// that retried after a timeout): JetStream's duplicate window cannot tell,
// the event-derived key can. The consumer charges once and acknowledges
// both. (The example runs its own JetStream server, in process.)
func Example() {
	dir, _ := os.MkdirTemp("", "natsconsumer-example")
	defer os.RemoveAll(dir)
	srv, _ := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT,
		JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	srv.Start()
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	if !srv.ReadyForConnections(10 * time.Second) {
		fmt.Println("the server did not start")
		return
	}
	nc, _ := nats.Connect(srv.ClientURL())
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, _ = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders"}})
	cons, _ := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "charges", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: -1})

	var charges atomic.Int64
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(nil))
	h, err := natsconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			charges.Add(1) // the side effect
			return nil
		},
		natsconsumer.WithKey(func(m natsconsumer.Message) (string, error) {
			return keygen.Event("order-charge", m.Header.Get("Order")), nil
		}),
		natsconsumer.WithLogger(nil))
	if err != nil {
		fmt.Println(err)
		return
	}
	done := make(chan error)
	go func() { done <- h.Consume(ctx, cons) }()

	for _, id := range []string{"msg-1", "msg-2"} { // one order, two message ids
		m := nats.NewMsg("orders")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Header.Set("Order", "42")
		m.Data = []byte(`{"order":42,"amount":"10.00"}`)
		_, _ = js.PublishMsg(ctx, m)
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		info, _ := cons.Info(ctx)
		if info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == 2 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
	fmt.Println("messages: 2, charges:", charges.Load())
	// Output: messages: 2, charges: 1
}
