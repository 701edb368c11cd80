module github.com/saferetry/saferetry/idempotency/amqpconsumer

go 1.25.0

replace (
	github.com/saferetry/saferetry => ../..
	github.com/saferetry/saferetry/idempotency/sqlstore => ../sqlstore
)

require (
	github.com/rabbitmq/amqp091-go v1.17.0
	github.com/saferetry/saferetry v0.0.0-00010101000000-000000000000
)

require (
	github.com/cenkalti/backoff/v4 v4.3.0 // indirect
	github.com/google/uuid v1.6.0 // indirect
	golang.org/x/time v0.14.0 // indirect
)
