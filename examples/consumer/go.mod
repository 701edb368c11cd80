module github.com/saferetry/saferetry/examples/consumer

go 1.25.0

replace (
	github.com/saferetry/saferetry => ../..
	github.com/saferetry/saferetry/idempotency/natsconsumer => ../../idempotency/natsconsumer
	github.com/saferetry/saferetry/idempotency/sqlstore => ../../idempotency/sqlstore
)
