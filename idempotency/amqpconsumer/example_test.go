package amqpconsumer_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"log"
	"os/signal"
	"syscall"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/amqpconsumer"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/keygen"
)

// A consumer of the queue "orders" charges each order once, whatever the
// broker redelivers: the charge is written in the transaction that stores
// the message's outcome, and acknowledged after it commits. (It needs a
// RabbitMQ and a PostgreSQL: the tests run the same code against real
// ones.)
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	db, err := sql.Open("pgx", "postgres://localhost/shop")
	if err != nil {
		log.Fatal(err)
	}
	store, err := sqlstore.Open(db, sqlstore.Postgres)
	if err != nil {
		log.Fatal(err)
	}
	mw := idempotency.New(store)
	h, err := amqpconsumer.New(mw, "charge",
		func(ctx context.Context, run *idempotency.Run, d amqp.Delivery) error {
			tx, ok := sqlstore.Tx(ctx) // commits with the stored outcome
			if !ok {
				return sql.ErrConnDone
			}
			_, err := tx.ExecContext(ctx, "INSERT INTO charges (body) VALUES ($1)", d.Body)
			return err
		},
		amqpconsumer.WithKey(func(d amqp.Delivery) (string, error) {
			var o struct{ Order string }
			if err := json.Unmarshal(d.Body, &o); err != nil {
				return "", err // undecodable: dead-lettered at once
			}
			return keygen.Event("order-charge", o.Order), nil
		}))
	if err != nil {
		log.Fatal(err)
	}
	for ctx.Err() == nil { // a new connection whenever the broker's is lost
		conn, err := amqp.Dial("amqp://guest:guest@localhost:5672/")
		if err != nil {
			log.Fatal(err)
		}
		ch, err := conn.Channel()
		if err == nil {
			err = ch.Qos(16, 0, false)
		}
		if err == nil {
			err = h.Consume(ctx, ch, "orders")
		}
		log.Print(err)
		_ = conn.Close()
	}
}
