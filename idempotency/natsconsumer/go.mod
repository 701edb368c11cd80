module github.com/saferetry/saferetry/idempotency/natsconsumer

go 1.25.0

replace (
	github.com/saferetry/saferetry => ../..
	github.com/saferetry/saferetry/idempotency/sqlstore => ../sqlstore
)

require (
	github.com/nats-io/nats.go v1.53.0
	github.com/saferetry/saferetry v0.0.0-00010101000000-000000000000
)

require (
	github.com/cenkalti/backoff/v4 v4.3.0 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/klauspost/compress v1.18.5 // indirect
	github.com/nats-io/nkeys v0.4.15 // indirect
	github.com/nats-io/nuid v1.0.1 // indirect
	golang.org/x/crypto v0.49.0 // indirect
	golang.org/x/sys v0.42.0 // indirect
	golang.org/x/time v0.14.0 // indirect
)
