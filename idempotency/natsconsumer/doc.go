// Package natsconsumer consumes NATS JetStream messages through saferetry's
// function door (idempotency.Middleware.Do), so that each message's effects
// take place effectively once within its key's scope and the store's
// replay window: at-least-once delivery plus de-duplication, never exactly
// once, which no network gives.
//
//	h, err := natsconsumer.New(mw, "charge", charge,
//		natsconsumer.WithKey(orderKey), // event-derived; default Nats-Msg-Id
//		natsconsumer.WithDeadLetter(js, "dead.orders"))
//	err = h.Consume(ctx, cons) // in n goroutines for n messages at a time
//
// JetStream drops a re-published Nats-Msg-Id only within the stream's
// duplicate window (2 minutes by default); a redelivery, or a re-publish
// after the window or under a new id, reaches the consumer again. The
// Handler keeps every message's record in the store, with a lease and a
// fence, for the store's replay window (24 h by default): keep that window
// above the longest time a message can come back (the duplicate window,
// a redelivery's delays, a dead letter replayed by hand).
//
// # The key and the scope
//
// A message's call has the scope (principal, operation, key):
//
//   - key: the producer's Nats-Msg-Id, or what WithKey's function returns
//     from the message: an event-derived key (keygen.Event("order-charge",
//     orderID)) makes a re-publish under a new message id the same call.
//     A message with neither is dead-lettered (reason key_missing), never
//     handled unguarded;
//   - principal: the stream's name (WithPrincipal sets another), and the
//     tenant WithTenant's function takes from the message, after a "/";
//   - operation: New's, naming what the Func does.
//
// The payload (the message's data) is the call's fingerprint: the same key
// with other data is a conflict, dead-lettered (key_reused).
//
// # What each outcome does to the message
//
//   - fresh: the Func runs; its outcome is stored (with sqlstore, its writes
//     through sqlstore.Tx and the record commit in one transaction: a
//     failure rolls them back; a definitive failure, stored, commits them,
//     as a stored 4xx does), then
//     the message is acknowledged with a double acknowledgement
//     (DoubleAck): a lost ack is known, logged, and the redelivery it brings
//     is answered from the store;
//   - completed duplicate: acknowledged without running the Func;
//   - in progress elsewhere: redelivered (NakWithDelay) when the other
//     execution's lease ends (idempotency.InProgressError); never
//     dead-lettered for it. If that execution died, its lease expires and
//     the redelivery takes the record over, fenced;
//   - definitive failure (the Func's error wraps idempotency.ErrDefinitive):
//     stored, and the message dead-lettered (definitive); a redelivery or a
//     duplicate gets the same verdict without running the Func;
//   - other failure (an error, a panic, an External call of unknown
//     outcome): the key is given up (or kept at its recovery point) and the
//     message redelivered after a full-jitter backoff (WithBackoff, from
//     package jitter), until its WithMaxAttempts-th delivery, which is
//     dead-lettered (attempts_exhausted);
//   - the store unavailable: redelivered after the backoff, never
//     dead-lettered for the outage;
//   - poison (no key, a key or tenant function that fails, a key keygen
//     refuses, a payload over the Middleware's WithMaxRequestBody):
//     dead-lettered at once (key_missing, key_invalid, tenant_missing,
//     invalid).
//
// Dead-lettering terminates the message (Term), after publishing a copy to
// WithDeadLetter's subject when it is set: the same data and headers (but
// the server's Nats-*), plus Saferetry-Reason (the reason above),
// Saferetry-Error (the error's message, at most 1 KiB), Saferetry-Stream,
// Saferetry-Sequence, Saferetry-Subject and Saferetry-Msg-Id (the original
// Nats-Msg-Id). To replay a dead letter, publish it with its original
// Nats-Msg-Id (or the same business key): it goes through the same claim.
//
// # Publishing from a handler
//
// Publish publishes as an External step of the Run, with a Nats-Msg-Id
// derived from Run.DownstreamKey: a redelivery resumes after a step that
// published, and one that finds the step's outcome unknown publishes again
// under the same id, which JetStream drops within its window (and a
// consumer keyed by message id after it).
//
// # What it cannot promise
//
//   - Effects outside the store's transaction (an e-mail, a call to another
//     service) are covered only through Run.Phase and Run.External, or by
//     the other service's own de-duplication (Run.DownstreamKey).
//   - A message that comes back after the store forgot its record (past
//     the replay window or the cleanup horizon) runs again.
//   - A consumer whose MaxDeliver is lower than WithMaxAttempts loses the
//     dead-lettering of the last attempts to JetStream's own limit: use
//     MaxDeliver -1.
package natsconsumer
