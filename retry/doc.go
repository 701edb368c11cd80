// Package retry is the pure half of the saferetry Transport's decision:
// [Classify] says whether one attempt's outcome may be retried and labels
// it with a [Class]; [Rule]s widen or narrow that allow-list per outcome;
// [ExhaustedError] is what the Transport returns when it stops without a
// response, with the [Reason] it stopped.
//
// The allow-list itself (which statuses and errors are retried, and when an
// unsafe request may be sent again) is stated once, in the documentation of
// package github.com/saferetry/saferetry. No Rule lifts its safety rules:
// a success and the caller's own cancellation are final, and a request that
// is not idempotent is retried only when it provably never left.
//
// Everything here is pure: no I/O, no clock (time is a parameter), no
// goroutines, and every function is safe for concurrent use.
package retry
