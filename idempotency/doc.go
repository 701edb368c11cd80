// Package idempotency is the server half of saferetry: net/http middleware
// that honours the Idempotency-Key header, so that a client's retries of one
// write take effect effectively once within the key scope and the replay
// window (at-least-once delivery plus de-duplication; nothing can promise
// more over an unreliable network).
//
// Wrap a handler with New and a Store:
//
//	store := idempotency.NewMemoryStore() // or sqlstore.Open(db, sqlstore.Postgres)
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//	http.Handle("POST /payments", mw(payments))
//
// Each key is scoped by (principal, method, route, key) and bound to a
// fingerprint of the request (Fingerprint). Its record moves from absent to
// in progress (claimed atomically, held by a lease with a fencing
// generation, heartbeated while the handler runs) to completed (the response
// stored and replayed with Idempotent-Replayed: true). Conflicts are RFC
// 9457 problem+json answers with stable codes (CodeInProgress,
// CodeKeyReused, ...). New documents every answer and which outcomes are
// stored or released.
//
// The Store interface is the contract between the middleware and its
// storage; MemoryStore implements it for tests and single-process use, the
// sqlstore package for SQLite and PostgreSQL, and the idempotencytest
// package holds the conformance suite every Store must pass. A store that
// also implements Transactor lets the handler's own writes commit in the
// same transaction as the stored response (Run.Unit, FromContext).
//
// The key header is not standardised (the IETF draft expired); the header
// name, the answers and the windows are this package's documented contract.
package idempotency
