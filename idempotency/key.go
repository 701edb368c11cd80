package idempotency

// DefaultKeyHeader is the request header that carries the idempotency key
// unless WithKeyHeader names another one. Its value is read by
// keygen.ParseHeader, the rule the client Transport applies before sending.
const DefaultKeyHeader = "Idempotency-Key"
