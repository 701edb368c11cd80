// Package idempotency is the server half of saferetry: one core with two
// doors, so that a client's retries of one write, a redelivered message and
// a job run again after a crash take effect effectively once within the
// key's scope and the replay window (at-least-once delivery plus
// de-duplication; nothing over a network does better). Wrap, the HTTP door,
// is net/http middleware that honours the Idempotency-Key header; Do, the
// function door, serves jobs, scripts and message consumers. Both go
// through the same claim, lease, fence, recovery points, completion and
// store. docs/CONTRACT.md is the contract for clients.
//
// The stores: memory, SQLite (embedded), PostgreSQL, MySQL/MariaDB or Redis
// (standalone, Sentinel or Cluster): package memstore, package sqlstore for
// the three SQL databases, package redisstore for Redis (see "Stores").
//
//	store := memstore.New() // or sqlstore.Open(db, sqlstore.Postgres), sqlstore.SQLite,
//	                        // sqlstore.MySQL; or redisstore.New(rdb)
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//	http.Handle("POST /payments", mw.Wrap(payments))
//	defer mw.Completer(map[string]http.Handler{"POST /payments": payments}).Start(ctx, 0)()
//	defer mw.Reaper().Start(ctx, 0)()
//
// A guarded request (POST or PATCH, WithMethods) with a key has the scope
// (principal, method, route, key) and a fingerprint of its method, route,
// path, query, content type and body. Its record goes from absent to in
// progress (claimed atomically, held by a lease with a fencing generation,
// heartbeated every lease/3) to completed (the response stored, replayed with
// Idempotent-Replayed: true). An expired lease is taken over and the
// request runs again from its recovery point; another fingerprint is
// refused. What the middleware answers in each case (status, problem code,
// Retry-After) is stated once, in the table of docs/CONTRACT.md, section 5
// ("What you can receive"); the codes are the Code* constants.
//
// 2xx, 3xx and 4xx answers but 408, 409, 425 and 429 are stored; the others,
// 5xx (unless WithStore5xx) and panics give the key up, so that a retry runs
// again, or, once a phase committed, keep it with its lease ended, so that
// the retry resumes. While an External call's outcome is unknown nothing is
// stored (CodeRequestIncomplete). Every answer of the middleware's own
// but the status body of a request in progress (see the status monitor) is
// RFC 9457 problem+json with a stable code.
//
// # The function door
//
// Do(ctx, Call{Principal, Operation, Key, Payload}, fn) runs fn effectively
// once for the scope (principal, operation, key) and returns its output,
// stored and replayed byte for byte; the fingerprint covers the payload.
// The states, options, stores, phases and Completer are those of requests:
//
//   - absent: fn runs with a Run (Phase, External, Unit, DownstreamKey,
//     Payload); its output is stored: Result{Output, Replayed: false};
//   - completed, same payload: Result{Output, Replayed: true}, fn not run;
//   - in progress, lease alive: ErrInProgress (after WithMaxInProgressWait);
//   - in progress, lease expired: taken over, fn resumes after the last
//     committed phase;
//   - another payload: ErrKeyReused;
//   - an error of fn gives the key up (kept after a committed phase, for a
//     resume); one wrapping ErrDefinitive is stored and returned to every
//     later call, as a stored 4xx is; a panic is a *PanicError; an output
//     over WithMaxStoredBody is not stored (ErrOutputTooLarge for later
//     calls); bad input is ErrInvalidCall before anything runs; a store
//     that fails, ErrStoreUnavailable.
//
// The Completer resumes the calls of Do through the functions given to it
// by Operation (Function), which find the payload in Run.Payload.
//
//	res, err := mw.Do(ctx, idempotency.Call{Principal: "ledger", Operation: "transfer",
//		Key: keygen.Event("transfer", msg.ID), Payload: msg.Body}, transfer)
//
// # The principal
//
// WithPrincipal's function names the authenticated caller of a request, the
// first part of its scope. A handler takes it from the library, never from
// the request: FromContext(ctx) returns the Run, and Run.Scope.Principal is
// that value, live and when the Completer resumes the request alike. A
// resumed request carries the method, URL, host, content type and body
// saved at the claim and no other header: no credentials, no cookies, no
// key. A 401 or 403 that a resumed handler (or an auth layer in front of
// it) answers is therefore never stored: the record waits for the client's
// retry, which has its credentials (see Completer).
//
// # Policy
//
// The replay window, the lease and the cleanup horizon (never less than the
// window plus the lease) are given once, to New, by WithReplayWindow,
// WithLease and WithCleanupHorizon, which state their defaults; the
// Middleware's Completer (which resumes requests abandoned by a crash) and
// Reaper (which deletes old records and reports unfinished ones) take them
// from it.
//
// # Stores
//
// Store is the contract between the core and its storage, six methods:
// memstore (bounded, in memory), sqlstore (SQLite, PostgreSQL, MySQL and
// MariaDB), redisstore (standalone, Sentinel, Cluster), and the conformance
// suite of idempotencytest that every Store passes, through both doors. A
// Transactor store lets the handler's (or fn's) writes commit with the
// stored response (Run.Unit, sqlstore.Tx); a ClaimTransactor lets a
// Middleware made WithOneTransaction(true) claim a fresh key in that very
// transaction, one commit per request for handlers whose effects are all
// in the store's database; a Sweeper lists and deletes
// records for the Completer and the Reaper. When the store ran a claim but
// its answer was lost, the record is read back: one that holds the
// claim's owner token is the claim's, and its work runs; no lease is left
// that nobody holds.
//
// # Atomic phases
//
// A handler (or fn) that creates an order, charges a card and writes a
// receipt runs each step as a phase of its Run (FromContext): Phase commits
// its writes with a recovery point, External records its intent before
// calling another service with a downstream key (the phase and a digest of
// the scope, never the client's key) and asks lookup on a resume before
// calling again, unless the other service answered that it did nothing
// (ErrNotExecuted). A retry, or the Completer, skips the committed phases;
// an owner whose lease was taken over commits nothing (ErrLeaseLost).
//
//	run, _ := idempotency.FromContext(ctx)
//	order, err := run.Phase(ctx, "order", insertOrder)
//	charge, err := run.External(ctx, "charge", cards.Charge, cards.Find)
//
// # The status monitor
//
// Monitor is an http.Handler, mounted where WithMonitor says, that answers
// what became of a request without running anything: by the identifier of
// a 202 Accepted (WithAcceptAfter: a request still running that long
// answers 202 with its monitor URL, and its handler runs on) or of an
// in-progress 409's Location, and by key (the key in its header, never in
// the URL, and "Idempotency-Lookup: POST /payments"): in progress (202,
// Retry-After, its age), completed (the stored response, as a replay gives
// it) or absent (404 CodeRequestAbsent: send the request again with the
// same key). It is scoped by principal as requests are; its identifiers are
// sealed under a secret of the fleet's and hold no form of the key.
//
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID),
//		idempotency.WithMonitor("/operations/", secret), idempotency.WithAcceptAfter(2*time.Second))
//	mux.Handle("GET /operations/", mw.Monitor(mux))
//
// # Observing
//
// The middleware's logs are written by a logging Observer (WithLogger):
// requests are named by method, route and key digest, never the raw key.
// WithObserver adds others (otelsaferetry.ServerObserver for metrics).
package idempotency
