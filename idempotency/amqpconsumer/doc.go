// Package amqpconsumer consumes RabbitMQ (AMQP 0-9-1) deliveries through
// saferetry's function door (idempotency.Middleware.Do), so that each
// message's effects take place effectively once within its key's scope and
// the store's replay window: at-least-once delivery plus de-duplication,
// never exactly once, which no network gives.
//
//	h, err := amqpconsumer.New(mw, "charge", charge,
//		amqpconsumer.WithKey(orderKey)) // event-derived; default message-id
//	_ = ch.Qos(16, 0, false)
//	err = h.Consume(ctx, ch, "orders") // in n goroutines for n messages at a time
//
// RabbitMQ de-duplicates nothing: a delivery whose acknowledgement was lost,
// a message requeued when its consumer died, a re-publish, all reach the
// consumer again. The Handler keeps every message's record in the store,
// with a lease and a fence, for the store's replay window (24 h by
// default): keep that window above the longest time a message can come
// back (a redelivery's delays, a dead letter replayed by hand).
//
// # The key and the scope
//
// A message's call has the scope (principal, operation, key):
//
//   - key: the producer's message-id property, or what WithKey's function
//     returns from the delivery: an event-derived key
//     (keygen.Event("order-charge", orderID)) makes a re-publish under a new
//     message id the same call. A message with neither is dead-lettered
//     (reason key_missing), never handled unguarded;
//   - principal: the queue's name (WithPrincipal sets another), and the
//     tenant WithTenant's function takes from the delivery, after a "/";
//   - operation: New's, naming what the Func does.
//
// The payload (the message's body) is the call's fingerprint: the same key
// with another body is a conflict, dead-lettered (key_reused).
//
// # What each outcome does to the message
//
//   - fresh: the Func runs; its outcome is stored (with sqlstore, its writes
//     through sqlstore.Tx and the record commit in one transaction: a
//     failure rolls them back; a definitive failure, stored, commits them,
//     as a stored 4xx does), then
//     the delivery is acknowledged. AMQP acknowledgements are not
//     confirmed: a lost one brings a redelivery, answered from the store;
//   - completed duplicate: acknowledged without running the Func;
//   - in progress elsewhere: comes back when the other execution's lease
//     ends (idempotency.InProgressError), without counting as an
//     attempt;
//   - definitive failure (the Func's error wraps idempotency.ErrDefinitive):
//     stored, and the message dead-lettered (definitive); a redelivery or a
//     duplicate gets the same verdict without running the Func;
//   - other failure (an error, a panic, an External call of unknown
//     outcome): the key is given up (or kept at its recovery point) and the
//     message comes back after a full-jitter backoff (WithBackoff, from
//     package jitter), until its WithMaxAttempts-th delivery, which is
//     dead-lettered (attempts_exhausted);
//   - the store unavailable: comes back after the backoff, never
//     dead-lettered for the outage;
//   - poison (no key, a key or tenant function that fails, a key keygen
//     refuses, a payload over the Middleware's WithMaxRequestBody):
//     dead-lettered at once (key_missing, key_invalid, tenant_missing,
//     invalid).
//
// Dead-lettering rejects the delivery without requeueing it, so RabbitMQ
// moves it to the queue's dead-letter exchange (declare the queue with
// x-dead-letter-exchange: without one RabbitMQ drops it), with its
// x-death header; the reason is in the Handler's log record, which names
// the message by its delivery tag and key digest. To replay a dead letter,
// publish it again with its message id (or the same business key): it
// goes through the same claim.
//
// # Coming back later, without a requeue loop
//
// AMQP 0-9-1 has no delayed negative acknowledgement, and a requeued
// message comes straight back. So a message that must come back later is
// published again, with a per-message TTL of the delay, to
// DelayQueue(queue), which Consume declares and which dead-letters expired
// messages back to the queue; the delivery is acknowledged once the broker
// has confirmed that copy (a crash in between leaves two copies, which the
// store tells apart). The copy keeps the properties and headers, and
// counts the Func's failures in the header x-saferetry-attempt. RabbitMQ
// expires messages at the head of a queue only, so a delay can stretch to
// the longest delay queued before it: at most the backoff's cap, or the
// lease. A delivery lost with its consumer (a crash, a closed connection)
// is requeued by the broker and counts no attempt; a message that kills
// every consumer it reaches is bounded by a quorum queue's delivery limit
// (x-delivery-limit), which dead-letters it.
//
// # Publishing from a handler
//
// Publish publishes as an External step of the Run, with a message id
// derived from Run.DownstreamKey: a redelivery resumes after a step that
// published, and one that finds the step's outcome unknown publishes again
// under the same id, which a consumer keyed by message id drops.
//
// # What it cannot promise
//
//   - Effects outside the store's transaction (an e-mail, a call to another
//     service) are covered only through Run.Phase and Run.External, or by
//     the other service's own de-duplication (Run.DownstreamKey).
//   - A message that comes back after the store forgot its record (past
//     the replay window or the cleanup horizon) runs again.
//   - Order: a message that comes back later is behind the ones published
//     meanwhile.
package amqpconsumer
