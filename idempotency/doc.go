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
// stored or released. A request with a key but no principal is refused
// (401 CodePrincipalMissing) unless the server opts in to one shared
// anonymous scope with WithAnonymousKeys. Once a key is claimed, the
// handler's context is not canceled when the client goes away, so that its
// response is stored for the client's retry; it ends on a lost lease, the
// request's deadline, or WithShutdown's context.
//
// The Store interface is the contract between the middleware and its
// storage; MemoryStore implements it for tests and single-process use
// (bounded: when full, new keys get 503 with Retry-After, ErrStoreFull), the
// sqlstore package for SQLite and PostgreSQL, and the idempotencytest
// package holds the conformance suite every Store must pass. A store that
// also implements Transactor lets the handler's own writes commit in the
// same transaction as the stored response (Run.Unit, FromContext).
//
// # Multi-step handlers: atomic phases
//
// A handler that creates an order, charges a card and writes a receipt must
// survive a crash between those steps without charging twice or losing the
// order. It runs each step as a named phase of its Run (FromContext):
//
//	func pay(w http.ResponseWriter, r *http.Request) {
//		ctx := r.Context()
//		run, _ := idempotency.FromContext(ctx)
//		order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
//			tx, _ := sqlstore.Tx(ctx) // the phase's own transaction
//			id := newOrderID()
//			_, err := tx.ExecContext(ctx, `INSERT INTO orders (id, amount) VALUES ($1, 4200)`, id)
//			return []byte(id), err // commits with the recovery point "order"
//		})
//		if err != nil { http.Error(w, "try again", 503); return }
//		charge, err := run.External(ctx, "charge",
//			func(ctx context.Context, key string) ([]byte, error) {
//				return cards.Charge(ctx, key, order, 4200) // sent as the processor's Idempotency-Key
//			},
//			func(ctx context.Context, key string) ([]byte, bool, error) {
//				return cards.Find(ctx, key) // the outcome of an earlier call under key, if any
//			})
//		if err != nil { http.Error(w, "try again", 503); return }
//		tx, _ := sqlstore.Tx(ctx) // the request's transaction: commits with the stored response
//		// Phase outputs are []byte: bind them as text (a []byte is a BLOB on SQLite).
//		_, err = tx.ExecContext(ctx, `INSERT INTO receipts (order_id, charge) VALUES ($1, $2)`,
//			string(order), string(charge))
//		...
//		w.WriteHeader(http.StatusCreated)
//	}
//
// Each Phase commits its own writes together with the record's recovery
// point and its output. External records the intent before calling, passes
// the call a downstream key derived from the request (Run.DownstreamKey),
// and commits the result. A 5xx or a panic after a committed phase keeps
// the record in progress and ends its lease at once. The next execution (the
// client's retry, or the Completer when no retry comes) skips the committed
// phases, getting their saved outputs; if it finds an intent without an
// outcome, it asks lookup under the same downstream key before calling
// again, with that key, so the processor de-duplicates too. An owner whose
// lease was taken over cannot commit a phase (ErrLeaseLost).
//
// # Background jobs
//
// A Completer drives abandoned requests (in progress, lease expired) to
// completion through the route's handler, so that a later retry gets the
// stored response. A Reaper deletes records past the cleanup horizon and
// logs the unfinished ones, for a person to act on.
//
// The key header is not standardised (the IETF draft expired); the header
// name, the answers and the windows are this package's documented contract.
package idempotency
