// Package linearizability checks that every idempotency.Store is linearizable:
// its tests record histories of concurrent Store calls (many goroutines on a
// few keys, under injected faults) and check them with porcupine against a
// sequential model of one record's state machine. The package has no API; it
// is a module of its own so that porcupine and the fault injectors stay out of
// every other module's graph. The "Linearizability" section of
// docs/DEVELOPMENT.md says what the check covers and how to run it.
package linearizability
