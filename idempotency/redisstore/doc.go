// Package redisstore keeps idempotency records in Redis: standalone,
// Sentinel or Cluster, through go-redis's redis.UniversalClient. Its Store
// implements idempotency.Store (not idempotency.Transactor: see below).
//
//	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true})
//	// or redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true,
//	//	ClusterStateReloadInterval: time.Second}),
//	// redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "m", SentinelAddrs: addrs, ...})
//	store, err := redisstore.New(rdb, redisstore.WithPrefix("payments:"))
//	defer store.Close() // stops its checks
//	mw := idempotency.New(store, idempotency.WithPrincipal(accountID))
//
// # One script per operation
//
// Every operation on a record is one Lua script on one slot: a record's
// hash, the two indexes of its shard and a write's nonce key share a hash
// tag, so the script runs unchanged on a Cluster, and records spread over
// 256 slots (the shard is the first byte of the SHA-256 of the scope's
// length-prefixed parts, whose first 16 bytes name the record, so scope
// parts of any bytes and length work). A Get too is a script, so that it
// reads the primary even through a client that sends reads to replicas.
// Round trips per guarded request: a new key costs two, the claim and the
// completion; a replay one, the claim that finds the completed record; an
// in-progress conflict (409) one. With WithReplicas, each write is
// followed by WAIT in the same round trip.
//
// # Fenced
//
// A claim creates the record with generation 1, or 1 more than a completed
// record it restarts past its replay window; a takeover of an expired lease
// (same fingerprint) bumps the generation and keeps the recovery point and
// the stored request. Every later write (heartbeat, end of lease, recovery
// point, completion, release) checks owner, generation and the in-progress
// state inside its script and writes nothing, answering
// idempotency.ErrLeaseLost, when they do not hold. Each write keeps its
// answer for twice its deadline (WithTimeout) under a nonce of its own, a
// key in the record's slot: go-redis sends a call again on a fresh
// connection when its connection failed, also after Redis ran it, and the
// call sent again answers what the first one did, whatever the record went
// through in between: a claim that created the record is the claimant's, a
// completion, a release or a heartbeat succeeded. A takeover whose record
// another claim took in between fails with an *OpError instead (what it
// found then is gone): its outcome is unknown, as for any failed call.
//
// # Expiry, the Completer and the Reaper
//
// Records expire in Redis itself, by the policy each claim carries (its
// ReplayWindow and LeaseFor, the middleware's), so the Store takes no
// policy of its own. Each write sets the record's time to live, which
// Redis counts from when it runs the write: a completed record lives its
// replay window plus a margin, the longer of its lease and a minute, so a
// replay within the window finds it even from a server whose clock is
// behind by less than that, with no Reaper; a record in progress lives its
// lease's remaining time, its window and margin, and a 30-day backstop.
// Each shard keeps a lease index (its records in progress, by lease end)
// and a done index (its completed records, by completion): Abandoned,
// which the Completer calls, reads the lease indexes of every shard in one
// pipelined round (one round trip per primary on a Cluster), never one hot
// key; members of records that Redis expired leave the indexes as the
// listings meet them, and a claim trims its shard's members that its own
// window, margin and backstop place past their record's life. What the
// Reaper still does: report each unfinished record (in progress, its lease
// over, for a person to check its side effects) before it deletes it past
// the middleware's cleanup horizon; Redis drops such a record, unreported,
// only the backstop after its window and margin, so a horizon under 30
// days, as the default 72 h is, always sees it first. Completed records
// need no Reaper; its DeleteBefore deletes the ones Redis still holds past
// the horizon. A claim with no replay window (ReplayWindow <= 0: never
// restarted) keeps its completed record for the backstop.
//
// # When Redis forgets
//
// A Redis restarted without persistence, a failover to an empty replica,
// FLUSHALL or an eviction lose records, and a retry of a request whose
// record was lost would run it again. So every shard holds a marker (a key
// of its slot with no expiry) that Redis loses with the records, and a
// claim that would create a record reads its shard's marker inside its
// script (no round trip of its own; replays, 409s and takeovers of the
// records Redis holds never read it). New arms a prefix that holds no
// marker at all, a new one, under an epoch of its own (Stores opened
// together agree on one); a Store trusts the markers of its epoch, and
// those an operator re-armed. A claim that finds its shard's marker gone,
// or armed again under another epoch (another server's New found the
// prefix empty), quarantines the shard and refuses; the Store logs it and
// quarantines at once every other shard that forgot. A claim that would
// create a record in a quarantined shard fails with an *OpError wrapping a
// *ForgottenError (errors.Is ErrForgotten): the middleware answers 503
// CodeStoreUnavailable, the key runs nowhere. The writes of a live owner
// whose record was lost fail with idempotency.ErrLeaseLost (its fence is
// gone with it), which stops its handler. Get reads what Redis holds: a
// lost record reads as absent (idempotency.ErrNotFound), and a claim is
// what refuses it.
//
// A quarantine ends in either of two ways. Rearm is the operator's word
// that claims may go on, accepting that a retried request whose record was
// lost runs again (reconcile those requests from the business data first,
// if they matter). Or, for each claim, once its replay window and the
// longer of its lease and a minute have passed since the detection: then
// no record that could have been lost is still inside its window, and its
// retry is a new request by the contract (for claims with no replay
// window, the 30-day backstop). Until then every new key in the
// quarantined shards is refused: for a store whose Redis may lose
// records, plan Rearm into the runbook. New on a prefix that shards
// quarantined stays quarantined (a server started afterwards refuses too);
// a Store opened with the markers of some shards gone quarantines them.
//
// What the markers cannot see: a Redis that forgot while no Store was
// running (every server restarted with it) looks new to the next New,
// which arms it; and between another server's New arming a forgotten
// prefix and a running Store's next claim or check, claims through the new
// Store trust it. A failover to a replica that lags loses only recent
// writes, the markers stay: see Asynchronous replication below.
//
// # Checks at New and every period
//
// New reads every server the client reaches (the server of a
// *redis.Client, through Sentinel the current primary; every primary and
// replica of a Cluster, since a replica may become a primary; every shard
// of a Ring) and refuses one whose maxmemory-policy is not noeviction
// (*EvictionPolicyError) or that keeps nothing on disk, no RDB save point
// and appendonly no (*PersistenceError), unless WithMemoryOnly(true)
// accepts that: tests, demos and caches, whose Redis loses its records
// with a restart (the markers still refuse new keys afterwards, until
// Rearm). A server that refuses CONFIG GET (managed services rename or
// forbid it) cannot be checked: New logs a warning through WithLogger and
// goes on; make sure of its settings yourself.
//
// A goroutine checks again every WithCheckInterval (10 s), until Close:
// one round trip per server (CONFIG GET of the policy and persistence,
// INFO stats and replication) and one pipelined read of the prefix's 256
// markers (one round trip per primary on a Cluster). A server that may
// evict keys refuses claims of new keys (an *OpError wrapping its
// *EvictionPolicyError: 503) until a check finds noeviction again;
// replays, 409s and writes of live owners go on, since a record found is
// a record kept. A server that evicted keys since the last check
// (evicted_keys grew) quarantines every shard, as a loss does. A server
// that stopped persisting is logged (a restart would then be caught by
// the markers); so is a primary with fewer replicas than WithReplicas
// asks for. Each finding is logged when it changes. A policy switched on
// and keys evicted within one period are caught by the next check: keys
// claimed in between may have run again.
//
// # What it cannot promise
//
// No transaction with the business write. Redis has no transaction that a
// handler's own writes (in another database, or in Redis) and the record
// could share, so the Store is not an idempotency.Transactor: Run.Unit
// fails with an error wrapping errors.ErrUnsupported, a phase runs its
// function with no unit, and the stored response is written after the
// handler's effects, in its own step. A crash between
// the two leaves the record in progress, and the request runs again after
// the lease, from its last recovery point. A handler on this store makes
// every write safe to run again: split the work into phases (Run.Phase,
// whose recovery point is written after the phase's function returns, so a
// crash before it runs the phase again), call other services through
// Run.External with its downstream key and lookup, and give its own writes
// a unique key (a SET NX, a unique constraint in its own database keyed by
// Run.DownstreamKey) so that a second run finds the first one's row instead
// of adding one.
//
// Asynchronous replication. Redis acknowledges a write before any replica
// has it: a failover (Sentinel, Cluster) can promote a replica that lacks an
// acknowledged claim or completion, and the request then runs again (a
// second execution), or a taken-over record comes back with its old owner.
// WithReplicas(n, timeout) makes every write wait (WAIT) until n replicas
// acknowledged it and fails the call with a *ReplicationError otherwise.
// It still does not cover: a failover to a replica other than those that
// acknowledged; a write lost by a crash of the primary and of those
// replicas together (replication is to memory; WAIT says nothing of disk:
// run with appendonly and appendfsync as your durability needs, and WAITAOF
// on Redis 7.2 or later is not used here); a failover between the write and
// the WAIT; and reads, which go to the primary only. It makes a lost claim
// unlikely, not impossible; for a guarantee that survives failover use
// sqlstore on a database with synchronous replication.
//
// After a failover, the promoted primary has the replicas that follow it
// (none, until one is attached, when each primary had one). With fewer
// than WithReplicas asks for, its writes fail: a claim of a new key there
// with a *ReplicationError (the middleware answers 503; the record it
// wrote stays in progress, unowned, until its lease ends), a completion
// with one too (the response is sent, unconfirmed on a replica); replays
// and 409s are answered after WAIT's timeout, since the WAIT of the same
// round trip waits for it. The Store's check logs it. The operator
// attaches a replica: restart the failed node, which rejoins as a replica
// of the new primary (Cluster, Sentinel), or CLUSTER REPLICATE a spare
// node; or runs n replicas and WithReplicas(n-1) per primary, so that one
// failover leaves enough.
//
// Eviction. Under a maxmemory-policy other than noeviction, a Redis at its
// maxmemory drops keys, records in progress and within their replay window
// included (every record has an expiry, so volatile-* policies drop them
// too), and their requests would run again. New refuses such a server and
// the checks refuse new keys while one is found (see above; through
// Sentinel only the current primary is read: set the policy on the
// replicas too). Under noeviction a Redis at its maxmemory refuses a claim
// of a new key (an *OpError wrapping idempotency.ErrStoreFull: 503
// CodeStoreFull), while completions, heartbeats, recovery points and
// releases of the records it holds go through (their scripts are
// allow-oom), as do replays; a takeover fails with an *OpError (503
// CodeStoreUnavailable) until memory is freed.
//
// # Cluster failover
//
// go-redis's Cluster client reloads its slot map on a MOVED answer, and
// otherwise every ClusterStateReloadInterval (60 s by default): a killed
// primary answers nothing, so calls for its slots fail until the map is
// reloaded, after the replica took over. Set ClusterStateReloadInterval:
// time.Second (one CLUSTER SLOTS a second per client while it is used):
// replays then answer again within seconds of the takeover. The Store's
// checks read the Cluster's nodes, which reloads the map too, every
// WithCheckInterval.
//
// # Bounded
//
// Every call has a deadline (WithTimeout, 5 s, within the caller's
// context); go-redis cuts a call at it with ContextTimeoutEnabled, and
// otherwise at its ReadTimeout and WriteTimeout: New refuses a client with
// neither (ErrUnboundedClient). A claim of a record over WithMaxRecordBytes
// (8 MiB) fails with idempotency.ErrRecordTooLarge (413) and writes
// nothing; the middleware's WithMaxRequestBody and WithMaxStoredBody bound
// what a record holds. Listings are bounded by their limit per shard.
//
// # Clocks
//
// The Store's operations read no clock (its checks date the quarantines
// they write by the local one): times come from its callers, so the servers
// need clocks that agree to well below the lease (NTP), as for every
// shared store: a server whose clock runs ahead takes over a live lease
// early (the fence stops the old owner's writes, but two executions
// overlapped). Redis counts times to live by its own clock, from each
// write, whatever the times the write carries.
//
// # Keys
//
// Under the prefix P (WithPrefix, "saferetry:"): P{xx}r:<digest> the record
// (a hash; the digest is the first 16 bytes of the scope's SHA-256, in hex,
// and xx its first byte, the shard), P{xx}lease and P{xx}done the shard's
// indexes (sorted sets), P{xx}marker the shard's marker (a string, no
// expiry), and P{xx}n:<nonce> a write's answer for a few seconds. Delete a
// store's data with the prefix (SCAN and DEL on each primary) while no
// Store of the prefix runs (a running one takes the markers' absence for a
// loss); never FLUSHALL a Redis that others share.
package redisstore
