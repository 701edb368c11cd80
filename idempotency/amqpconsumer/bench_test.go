package amqpconsumer_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/amqpconsumer"
)

// BenchmarkConsume measures a consumer's throughput, side by side: a bare
// consumer (write, then ack) and a guarded one (amqpconsumer: the same
// write in the transaction of the stored outcome, then ack), on SQLite and
// PostgreSQL, 4 consumers at a time (a channel each, prefetch 16). Each
// iteration is one message; report msgs/s, and the ratio guarded/bare per
// store:
//
//	SAFERETRY_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ SAFERETRY_PG_DSN=... \
//	  go test -run '^$' -bench BenchmarkConsume -benchtime 2000x -count 3 ./idempotency/amqpconsumer/
func BenchmarkConsume(b *testing.B) {
	for _, store := range []string{"sqlite", "postgres"} {
		for _, kind := range []string{"bare", "guarded"} {
			b.Run(store+"/"+kind, func(b *testing.B) { benchConsume(b, store == "postgres", kind) })
		}
	}
}

func benchConsume(b *testing.B, postgres bool, kind string) {
	u := amqpURL(b)
	conn, ch := dial(b, u)
	q := newQueue(b, u)
	db, store, err := newDB(b, postgres).openStore(context.Background(), true)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	var last *amqp.DeferredConfirmation
	for i := range b.N {
		last, err = ch.PublishWithDeferredConfirmWithContext(context.Background(), "", q.name,
			false, false, amqp.Publishing{MessageId: fmt.Sprintf("m-%d", i),
				Body: fmt.Appendf(nil, "order-%d", i), DeliveryMode: amqp.Persistent})
		if err != nil {
			b.Fatal(err)
		}
	}
	if ok, err := last.WaitContext(context.Background()); err != nil || !ok {
		b.Fatal("the publishes were not confirmed", err)
	}
	mw := idempotency.New(store, idempotency.WithLogger(nil))
	h, err := amqpconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			return effect(ctx, string(d.Body))
		}, amqpconsumer.WithLogger(nil))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.ResetTimer()
	var wg sync.WaitGroup
	var done sync.WaitGroup
	done.Add(b.N)
	for range 4 {
		c, err := conn.Channel()
		if err == nil {
			err = c.Qos(16, 0, false)
		}
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if kind == "guarded" {
				err = h.Consume(ctx, c, q.name)
			} else {
				err = bareConsume(ctx, db, c, q.name)
			}
			if err != nil {
				b.Error(err)
			}
		}()
	}
	for n := 0; n < b.N; {
		time.Sleep(5 * time.Millisecond)
		if err := db.QueryRow("SELECT count(*) FROM effects").Scan(&n); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cancel()
	wg.Wait()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// bareConsume is the consumer without the guard: the same write, then the
// same acknowledgement.
func bareConsume(ctx context.Context, db *sql.DB, ch *amqp.Channel, queue string) error {
	deliveries, err := ch.ConsumeWithContext(ctx, queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	for d := range deliveries {
		if _, err := db.ExecContext(ctx,
			"INSERT INTO effects (business_key, pid) VALUES ($1, 0)", string(d.Body)); err != nil {
			_ = d.Nack(false, true)
			continue
		}
		_ = d.Ack(false)
	}
	return nil
}
