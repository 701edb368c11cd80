// Package keygen makes and checks idempotency keys: the value of the
// Idempotency-Key header that lets a server de-duplicate the retries of one
// logical request, so that a retried write takes effect effectively once
// within the server's key scope and replay window.
//
// # Choosing a key
//
// The rule is one stable key per logical request, fixed before the first
// attempt and reused by every retry. Ranked best first:
//
//  1. Event-derived keys ([Event]): computed from the business event the
//     request carries out, for example Event("order-confirm", orderID). They
//     are deterministic, so a process that crashes and starts over, a job
//     re-run or a dead-letter replay computes the same key again: a retry
//     cannot forget it.
//  2. Request-scoped keys ([NewContext], [FromContext]):
//     a key attached to a context once per logical outgoing operation and
//     reused by that operation's request and every re-run of it within the
//     process. One key belongs to one operation: a unit of work that makes
//     several writes derives one key per write (Event(key, "charge")).
//  3. A random key kept across retries ([Random]): a fresh UUIDv4 generated
//     once per logical request and reused by every attempt. This is what the
//     saferetry Transport attaches to POST and PATCH requests that carry no
//     key. It protects the retries of one call, but a caller that restarts
//     the whole operation gets a new key and therefore a second execution.
//
// The anti-pattern is a new value per attempt: a key that changes between
// attempts of the same logical request de-duplicates nothing and gives a
// false sense of safety. The saferetry Transport makes it impossible by fixing
// the key before attempt 1.
//
// # Validation
//
// [Validate] accepts 1 to 255 bytes of visible ASCII and inner
// spaces (0x20 to 0x7E; no space first or last): no control characters, no
// non-ASCII bytes. That is what real clients send (stripe-go sends any key
// of up to 255 characters after trimming spaces, such as "order 42" or
// "invoice,2024-7"). [ParseHeader] reads a key from its header (one field
// line, bare or an RFC 9651 sf-string) and [FormatHeader] writes one; the
// Transport and the middleware both use them. Every non-empty result of
// [Event] and every result of [Random] is valid and is sent bare.
//
// All functions are safe for concurrent use.
package keygen
