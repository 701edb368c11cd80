package natsconsumer_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/natsconsumer"
)

// BenchmarkConsume measures a consumer's throughput, side by side: a bare
// consumer (write, then DoubleAck) and a guarded one (natsconsumer: the
// same write in the transaction of the stored outcome, then DoubleAck), on
// SQLite and PostgreSQL, 4 consumers at a time. Each iteration is one
// message; report msgs/s, and the ratio guarded/bare per store:
//
//	SAFERETRY_NATS_URL=nats://127.0.0.1:4222 SAFERETRY_PG_DSN=... \
//	  go test -run '^$' -bench BenchmarkConsume -benchtime 2000x -count 3 ./idempotency/natsconsumer/
func BenchmarkConsume(b *testing.B) {
	for _, store := range []string{"sqlite", "postgres"} {
		for _, kind := range []string{"bare", "guarded"} {
			b.Run(store+"/"+kind, func(b *testing.B) { benchConsume(b, store == "postgres", kind) })
		}
	}
}

func benchConsume(b *testing.B, postgres bool, kind string) {
	u := natsURL(b)
	_, js := connect(b, u)
	s := newStream(b, js, 0)
	s.consumer(b, js, 30*time.Second)
	db, store, err := newDB(b, postgres).openStore(context.Background(), true)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	for i := range b.N {
		m := &nats.Msg{Subject: s.subject, Data: fmt.Appendf(nil, "order-%d", i),
			Header: nats.Header{}}
		m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("m-%d", i))
		if _, err := js.PublishMsgAsync(m); err != nil {
			b.Fatal(err)
		}
	}
	<-js.PublishAsyncComplete()
	mw := idempotency.New(store, idempotency.WithLogger(nil))
	h, err := natsconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, m natsconsumer.Message) error {
			return effect(ctx, string(m.Data))
		}, natsconsumer.WithLogger(nil))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.ResetTimer()
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cons, err := js.Consumer(ctx, s.name, "workers")
			if err != nil {
				b.Error(err)
				return
			}
			if kind == "guarded" {
				err = h.Consume(ctx, cons)
			} else {
				err = bareConsume(ctx, db, cons)
			}
			if err != nil {
				b.Error(err)
			}
		}()
	}
	for {
		p, a := s.pending(b, js)
		if p == 0 && a == 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.StopTimer()
	cancel()
	wg.Wait()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
	if n := len(effects(b, db)); n != b.N {
		b.Fatalf("%d effects for %d messages", n, b.N)
	}
}

// bareConsume is the consumer without the guard: the same write, then the
// same double acknowledgement.
func bareConsume(ctx context.Context, db *sql.DB, cons jetstream.Consumer) error {
	it, err := cons.Messages(jetstream.PullMaxMessages(16))
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
		if _, err := db.ExecContext(ctx,
			"INSERT INTO effects (business_key, pid) VALUES ($1, 0)", string(m.Data())); err != nil {
			_ = m.Nak()
			continue
		}
		_ = m.DoubleAck(ctx)
	}
}
