package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/headercodec"
	"github.com/saferetry/saferetry/internal/scopedigest"
	"github.com/saferetry/saferetry/internal/unixnano"
)

// The options' defaults.
const (
	// DefaultPrefix is the key prefix of WithPrefix.
	DefaultPrefix  = "saferetry:"
	defaultTimeout = 5 * time.Second
	// 8 MiB: the middleware's default request body (1 MiB) and more.
	defaultMaxRecordBytes = 8 << 20
	// newTimeout bounds New's checks.
	newTimeout = 10 * time.Second
)

// Expiry (see keepFor): Redis keeps a completed record its replay window
// plus the longer of its lease and minMargin, and a record in progress a
// backstop longer.
const (
	// minMargin is the least time Redis keeps a completed record past its
	// replay window: a server whose clock is behind the one that
	// completed it, by less than the margin, still finds it.
	minMargin = time.Minute
	// backstop is how much longer than that Redis keeps a record in
	// progress, counted from its last write past its lease: a Reaper has
	// that long past the replay window to report it unfinished.
	backstop = 30 * 24 * time.Hour
)

// shards is the number of slots a Store's records spread over: each
// record's keys share the hash tag of its shard, the first byte of its
// scope's digest, so that one script reaches the record and its shard's
// indexes on a Cluster. The Completer's and the Reaper's listings read
// every shard, pipelined (one round trip per primary).
const shards = 256

// Errors returned by New and by the Store's methods.
var (
	// ErrNilClient is returned by New for a nil client.
	ErrNilClient = errors.New("redisstore: nil client")
	// ErrInvalidPrefix is returned by New for a WithPrefix prefix that
	// holds '{': a hash tag in the prefix would put every record in one
	// slot.
	ErrInvalidPrefix = errors.New("redisstore: the key prefix holds '{'")
	// ErrUnboundedClient is returned by New for a client whose calls have
	// no time limit: a ReadTimeout or WriteTimeout of -1 or -2 (none)
	// without ContextTimeoutEnabled, so that neither the socket nor the
	// Store's deadline (WithTimeout) would end a call to a Redis that hangs.
	ErrUnboundedClient = errors.New("redisstore: the client's calls have no time limit " +
		"(ReadTimeout or WriteTimeout < 0 without ContextTimeoutEnabled)")
	// ErrReplicasUnsupported is returned by New for WithReplicas on a
	// client other than *redis.Client (standalone or Sentinel) and
	// *redis.ClusterClient: WAIT must run on the primary and the
	// connection that wrote.
	ErrReplicasUnsupported = errors.New(
		"redisstore: WithReplicas needs a *redis.Client or a *redis.ClusterClient")
	// ErrEvictionPolicy is matched (errors.Is) by the *EvictionPolicyError
	// that New returns for a primary whose maxmemory-policy is not
	// noeviction.
	ErrEvictionPolicy = errors.New("redisstore: maxmemory-policy is not noeviction")
	// ErrNotReplicated is matched by the *ReplicationError of a write that
	// fewer replicas than WithReplicas asked for acknowledged in time.
	ErrNotReplicated = errors.New("redisstore: write not acknowledged by enough replicas")
)

// EvictionPolicyError is New's refusal of a Redis that may evict records:
// under any maxmemory-policy but noeviction (volatile-* ones included,
// since every record has an expiry), a Redis at its maxmemory drops keys,
// and a dropped record in progress or within its replay window runs its
// request again. It matches ErrEvictionPolicy.
type EvictionPolicyError struct {
	Addr   string // the primary's address
	Policy string // its maxmemory-policy
}

// Error returns "redisstore: <addr>: maxmemory-policy <policy> ...".
func (e *EvictionPolicyError) Error() string {
	return "redisstore: " + e.Addr + ": maxmemory-policy " + e.Policy +
		" can evict records in progress or within their replay window; set it to noeviction"
}

// Is reports whether target is ErrEvictionPolicy.
func (e *EvictionPolicyError) Is(target error) bool { return target == ErrEvictionPolicy }

// ReplicationError is the error of a write that fewer than Want replicas
// acknowledged (WAIT) within the WithReplicas timeout. The write is
// applied on the primary: it may or may not survive a failover. For a
// Claim the middleware answers 503 and the client's retry finds the
// record; for a Complete it sends the response anyway. It matches
// ErrNotReplicated.
type ReplicationError struct {
	Op        string // the Store operation, as in OpError
	Want, Got int    // replicas asked for, replicas that acknowledged
}

// Error returns "redisstore: <op>: <got> of <want> replicas acknowledged".
func (e *ReplicationError) Error() string {
	return fmt.Sprintf("redisstore: %s: %d of %d replicas acknowledged the write in time",
		e.Op, e.Got, e.Want)
}

// Is reports whether target is ErrNotReplicated.
func (e *ReplicationError) Is(target error) bool { return target == ErrNotReplicated }

// OpError wraps an error of Redis (or of the network to it) with the Store
// operation that met it ("new", "claim", "get", "heartbeat",
// "complete", "release", "set_recovery_point", "abandoned",
// "delete_before", "rearm"). The middleware answers such errors 503
// CodeStoreUnavailable; a claim on a Redis over its maxmemory wraps
// idempotency.ErrStoreFull (503 CodeStoreFull). Use errors.As to read Op,
// errors.Is and errors.As on it to reach the cause.
type OpError struct {
	Op  string
	Err error
}

// Error returns "redisstore: <op>: <cause>".
func (e *OpError) Error() string { return "redisstore: " + e.Op + ": " + e.Err.Error() }

// Unwrap returns the cause.
func (e *OpError) Unwrap() error { return e.Err }

// errScopeMismatch is the cause of the *OpError of a claim or a read that
// finds under a scope's digest a record of other scope parts: a SHA-256
// collision, or a key written by something other than this package.
var errScopeMismatch = errors.New(
	"the stored record's scope differs from the one asked for (digest collision?)")

// errRetryChanged is the cause of the *OpError of a takeover that go-redis
// sent again after its connection failed, when Redis had run it and another
// claim took the record before the retry: what the takeover found (its
// recovery point) is gone, so its outcome is unknown to the caller.
var errRetryChanged = errors.New("a takeover sent again after a lost reply found the record " +
	"taken since: its outcome is unknown")

// errCorrupt is the cause of the *OpError of a read of a record whose
// fields this package did not write.
var errCorrupt = errors.New("malformed record")

// Option configures New. Options are applied in order; a later one wins.
type Option func(*config)

type config struct {
	prefix      string
	timeout     time.Duration
	maxRecord   int64
	replicas    int
	waitTimeout time.Duration
	logger      *slog.Logger
	memoryOnly  bool
	checkEvery  time.Duration
}

// WithPrefix sets the prefix of every key the Store writes (default
// DefaultPrefix, "saferetry:"). Stores with different prefixes on one
// Redis are independent. A prefix holding '{' is refused by New
// (ErrInvalidPrefix).
func WithPrefix(prefix string) Option {
	return func(c *config) { c.prefix = prefix }
}

// WithTimeout sets the deadline of each of the Store's calls to Redis
// (default 5 s), within the caller's context: Listings (Abandoned,
// DeleteBefore) have it per pipelined round. go-redis cuts a call at this
// deadline only with ContextTimeoutEnabled; otherwise its ReadTimeout and
// WriteTimeout bound it. Each write keeps its answer in a key of about 100
// bytes for twice this deadline (see the package documentation), so a
// long deadline holds more of them. Values <= 0 keep the default.
func WithTimeout(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.timeout = d
		}
	}
}

// WithMaxRecordBytes sets the largest record a Claim creates, counted as
// the bytes of its scope, fingerprint, owner and stored request (default 8
// MiB); a larger one fails with idempotency.ErrRecordTooLarge (413) and
// writes nothing. Completions and recovery points are never refused for
// their size: the middleware's WithMaxStoredBody bounds a stored body.
// Values <= 0 keep the default; math.MaxInt64 means no limit.
func WithMaxRecordBytes(n int64) Option {
	return func(c *config) {
		if n > 0 {
			c.maxRecord = n
		}
	}
}

// WithReplicas makes every write wait (WAIT) until n replicas of the
// record's primary acknowledged it, for at most timeout; a write that fewer
// acknowledged fails with a *ReplicationError (see it for what the
// middleware then does). A timeout <= 0 means half the WithTimeout
// deadline. Default n 0: no wait. n <= 0 means no wait. It needs a
// *redis.Client or *redis.ClusterClient (New: ErrReplicasUnsupported).
// What it does not cover is in the package documentation.
func WithReplicas(n int, timeout time.Duration) Option {
	return func(c *config) { c.replicas, c.waitTimeout = max(n, 0), timeout }
}

// WithLogger sets the logger of what New and the Store's checks find
// (default slog.Default()): a server whose settings cannot be read (CONFIG
// GET refused), a server that may evict keys or keeps nothing on disk, a
// primary with fewer replicas than WithReplicas asks for, the shards
// quarantined because Redis lost records, a re-arming. nil means no
// logging.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithMemoryOnly(true) accepts a Redis that keeps nothing on disk (no RDB
// save point, appendonly no), which New otherwise refuses with a
// *PersistenceError: for tests, demos and caches whose records may be lost
// with a restart. A restart of such a Redis still refuses claims of new
// keys until Rearm (see the package documentation). Default false.
func WithMemoryOnly(accept bool) Option {
	return func(c *config) { c.memoryOnly = accept }
}

// WithCheckInterval sets the period of the Store's checks of its servers
// and markers (default 10 s): on every server the client reaches (every
// primary and replica of a Cluster), one round trip that reads
// maxmemory-policy, persistence, evicted_keys and replicas; and one
// pipelined round that reads the prefix's 256 markers (one per primary on
// a Cluster). A claim that finds its shard forgotten starts a check at
// once. Each check has the deadline of one call (WithTimeout). Values <= 0
// keep the default.
func WithCheckInterval(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.checkEvery = d
		}
	}
}

// Store is an idempotency.Store over Redis: standalone, Sentinel or
// Cluster, through a redis.UniversalClient. It is safe for concurrent use
// by many goroutines and many processes sharing the Redis and the prefix.
// Its operations read no clock: every time comes from their arguments
// (Redis expires records by its own clock, at times computed from them);
// its checks, in a goroutine of its own that Close stops, date the
// quarantines they write by the local clock. It is not an
// idempotency.Transactor (see the package documentation).
type Store struct {
	rdb     redis.UniversalClient
	cfg     config
	shards  *[shards]shardKeys
	guard   *guard
	nonceID string        // random, per Store: the base of its calls' nonces
	nonces  atomic.Uint64 // the calls' nonces
}

var _ idempotency.Store = (*Store)(nil)

// New returns a Store over rdb, configured by opts, and starts its checks
// (WithCheckInterval; Close stops them). On the server of a *redis.Client
// (the current primary, through Sentinel), on every primary and replica of
// a Cluster and on every shard of a Ring, it checks that maxmemory-policy
// is noeviction (an *EvictionPolicyError otherwise) and, unless
// WithMemoryOnly, that the server persists (a *PersistenceError
// otherwise); a server that refuses CONFIG GET, as managed services may, is
// logged through WithLogger and accepted. It then reads the prefix's
// markers: it arms a prefix that holds none (a new one), and quarantines
// the shards that lost theirs (see the package documentation). All of it is
// bounded by 10 seconds. Errors: ErrNilClient, ErrInvalidPrefix,
// ErrUnboundedClient, ErrReplicasUnsupported, *EvictionPolicyError,
// *PersistenceError, or an *OpError with Op "new" when Redis cannot be
// reached. The caller keeps rdb and closes it after the Store's Close.
func New(rdb redis.UniversalClient, opts ...Option) (*Store, error) {
	if rdb == nil {
		return nil, ErrNilClient
	}
	cfg := config{prefix: DefaultPrefix, timeout: defaultTimeout, maxRecord: defaultMaxRecordBytes,
		logger: slog.Default(), checkEvery: defaultCheckInterval}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if strings.Contains(cfg.prefix, "{") {
		return nil, fmt.Errorf("%w: %q", ErrInvalidPrefix, cfg.prefix)
	}
	if cfg.waitTimeout <= 0 {
		cfg.waitTimeout = cfg.timeout / 2
	}
	if err := checkBounded(rdb); err != nil {
		return nil, err
	}
	if cfg.replicas > 0 {
		switch rdb.(type) {
		case *redis.Client, *redis.ClusterClient:
		default:
			return nil, ErrReplicasUnsupported
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), newTimeout)
	defer cancel()
	sh := newShards(cfg.prefix)
	s := &Store{rdb: rdb, cfg: cfg, shards: sh}
	s.guard = newGuard(rdb, sh, &s.cfg)
	if err := s.guard.checkNew(ctx); err != nil {
		return nil, err
	}
	if err := s.guard.arm(ctx, time.Now()); err != nil {
		return nil, opErr("new", err)
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	s.nonceID = hex.EncodeToString(id[:])
	s.guard.start()
	return s, nil
}

// Rearm ends every quarantine of the prefix (see the package
// documentation): the operator's word that claims of new keys may go on,
// accepting that a request whose record Redis lost runs again if it is
// retried. It writes the marker of each of the 256 shards, in one
// pipelined round (one per primary on a Cluster), and logs it. Every Store
// of the prefix trusts the markers it writes at once. Errors are *OpError
// with Op "rearm"; a Rearm that failed may have re-armed some shards: call
// it again.
func (s *Store) Rearm(ctx context.Context) error {
	ctx, cancel := s.call(ctx)
	defer cancel()
	mark := "r" + strconv.FormatInt(ns(time.Now()), 10)
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range s.shards {
			p.Set(ctx, s.shards[i].marker, mark, 0)
		}
		return nil
	})
	if err != nil {
		return opErr("rearm", err)
	}
	s.guard.log(slog.LevelWarn, "redisstore: re-armed by the operator: claims of new keys go on, "+
		"and a request whose record Redis lost runs again if it is retried", "prefix", s.cfg.prefix)
	return nil
}

// Close stops the Store's checks (WithCheckInterval) and returns when they
// stopped: at once, or once a check under way ends, within its deadline
// (WithTimeout). It always returns nil, and a second Close does nothing.
// It does not close the client. Call it after the Store's last use: the
// Store's methods still work after Close, but no check notices a server
// that may evict keys any more.
func (s *Store) Close() error {
	s.guard.close()
	return nil
}

// checkBounded refuses a client whose calls have no time limit. A Client's
// and a ClusterClient's options hold their defaults applied (a timeout of 0
// or less is none); a Ring's hold what was given (0 is the default, less is
// none).
func checkBounded(rdb redis.UniversalClient) error {
	none := false
	switch c := rdb.(type) {
	case *redis.Client:
		o := c.Options()
		none = (o.ReadTimeout <= 0 || o.WriteTimeout <= 0) && !o.ContextTimeoutEnabled
	case *redis.ClusterClient:
		o := c.Options()
		none = (o.ReadTimeout <= 0 || o.WriteTimeout <= 0) && !o.ContextTimeoutEnabled
	case *redis.Ring:
		o := c.Options()
		none = (o.ReadTimeout < 0 || o.WriteTimeout < 0) && !o.ContextTimeoutEnabled
	}
	if none {
		return ErrUnboundedClient
	}
	return nil
}

// keys are the Redis keys of one scope: its record and its shard's
// indexes, which share one hash tag; member names the record in them.
type keys struct {
	tag, rec, lease, done, marker, member string
}

// keysOf names a scope's keys: its shard is the first byte of its digest,
// its member the first 16 bytes in hex (128 bits: no two scopes of a
// store meet; if two ever did, the record's stored scope tells them apart
// and the claim fails, never answering another scope's record).
func (s *Store) keysOf(sc idempotency.Scope) keys {
	d := scopedigest.Sum(sc.Principal, sc.Method, sc.Route, sc.Key)
	return s.keysFor(int(d[0]), hex.EncodeToString(d[:16]))
}

// shardKeys are the names of one shard's keys but its records'.
type shardKeys struct {
	tag, lease, done, marker string // P{xx}, P{xx}lease, P{xx}done, P{xx}marker
}

// newShards names the keys of every shard under prefix.
func newShards(prefix string) *[shards]shardKeys {
	var ks [shards]shardKeys
	for i := range ks {
		tag := prefix + "{" + hex.EncodeToString([]byte{byte(i)}) + "}"
		ks[i] = shardKeys{tag: tag, lease: tag + "lease", done: tag + "done", marker: tag + "marker"}
	}
	return &ks
}

func (s *Store) keysFor(shard int, member string) keys {
	sk := &s.shards[shard]
	return keys{tag: sk.tag, rec: sk.tag + "r:" + member, lease: sk.lease, done: sk.done,
		marker: sk.marker, member: member}
}

// nonce returns the key, in k's slot, of a name no other call of any Store
// uses: a write's script keeps its answer there, and finds it when go-redis
// sends the call again (see scripts.go).
func (s *Store) nonce(k keys) string {
	return k.tag + "n:" + s.nonceID + strconv.FormatUint(s.nonces.Add(1), 36)
}

// nonceTTL is how long, in milliseconds, a write's answer is kept under its
// nonce: twice the call's deadline, past which go-redis sends it no more.
func (s *Store) nonceTTL() int64 { return max(mulSat(s.cfg.timeout, 2).Milliseconds(), 1) }

// call returns the context of one call to Redis: ctx with at most the
// WithTimeout deadline left.
func (s *Store) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.timeout)
}

// run runs a script that writes on k's slot, and with WithReplicas waits
// for the replicas in the same round trip. wrote reports from the script's
// answer whether it wrote (a fenced write refused writes nothing, so no
// replica need acknowledge it).
func (s *Store) run(ctx context.Context, op string, sc *redis.Script, k []string,
	wrote func(any) bool, args ...any) (any, error) {
	if s.cfg.replicas <= 0 {
		v, err := sc.Run(ctx, s.rdb, k, args...).Result()
		if err != nil {
			return nil, err
		}
		return v, nil
	}
	var v any
	var acked int64
	for try := 0; ; try++ {
		node, err := s.primaryFor(ctx, k[0])
		if err != nil {
			return nil, err
		}
		var eval *redis.Cmd
		var wait *redis.Cmd
		// Each command's error is read from it: Pipelined returns the first.
		_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
			eval = sc.EvalSha(ctx, p, k, args...)
			wait = p.Do(ctx, "wait", s.cfg.replicas, s.cfg.waitTimeout.Milliseconds())
			return nil
		})
		if redis.HasErrorPrefix(eval.Err(), "NOSCRIPT") {
			_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
				eval = sc.Eval(ctx, p, k, args...)
				wait = p.Do(ctx, "wait", s.cfg.replicas, s.cfg.waitTimeout.Milliseconds())
				return nil
			})
		}
		if moved(eval.Err()) && try == 0 {
			if cc, ok := s.rdb.(*redis.ClusterClient); ok {
				cc.ReloadState(ctx)
				continue
			}
		}
		if err := eval.Err(); err != nil {
			return nil, err
		}
		v = eval.Val()
		if !wrote(v) {
			return v, nil
		}
		if err := wait.Err(); err != nil {
			return nil, err
		}
		acked, _ = wait.Int64()
		break
	}
	if acked < int64(s.cfg.replicas) {
		return v, &ReplicationError{Op: op, Want: s.cfg.replicas, Got: int(acked)}
	}
	return v, nil
}

// moved reports whether err is a Cluster redirection.
func moved(err error) bool {
	return redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK")
}

// primaryFor returns the client of the primary that holds key.
func (s *Store) primaryFor(ctx context.Context, key string) (*redis.Client, error) {
	switch c := s.rdb.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	case *redis.Client:
		return c, nil
	}
	return nil, ErrReplicasUnsupported
}

func opErr(op string, err error) error {
	if err == nil {
		return nil
	}
	var oe *OpError
	var re *ReplicationError
	if errors.As(err, &oe) || errors.As(err, &re) {
		return err
	}
	switch {
	case redis.HasErrorPrefix(err, "SCOPE"):
		err = errScopeMismatch
	case redis.HasErrorPrefix(err, "RETRY"):
		err = errRetryChanged
	}
	return &OpError{Op: op, Err: err}
}

// Times are decimal Unix nanoseconds in records, microseconds in index
// scores, milliseconds in expiries. The numbers are passed to Redis as
// int64, which go-redis writes in decimal: no string of their own.
func ns(t time.Time) int64 { return unixnano.Of(t) }

// micros returns t's index score.
func micros(t time.Time) int64 { return unixnano.Of(t) / 1000 }

// mulSat returns d * k, saturating.
func mulSat(d time.Duration, k int64) time.Duration {
	if d > 0 && d > math.MaxInt64/time.Duration(k) {
		return math.MaxInt64
	}
	return d * time.Duration(k)
}

// Claim implements idempotency.Store.Claim with one script on the scope's
// slot (see the package documentation). A claim whose record would be over
// WithMaxRecordBytes fails with idempotency.ErrRecordTooLarge; one that
// would create a record on a Redis over its maxmemory, with an *OpError
// wrapping idempotency.ErrStoreFull (a takeover there fails with a plain
// *OpError: the store is full only for new keys). One that would create a
// record in a shard that may have forgotten records fails with an *OpError
// wrapping a *ForgottenError, and while a server may evict keys, with one
// wrapping an *EvictionPolicyError; both create nothing. Other errors are
// *OpError with Op "claim" (a digest collision among them) or a
// *ReplicationError.
func (s *Store) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	return s.claim(ctx, c, claimScript)
}

// claim is Claim with the script sc.
func (s *Store) claim(ctx context.Context, c idempotency.Claim, sc *redis.Script) (
	idempotency.ClaimResult, error) {
	size := int64(len(c.Scope.Principal)) + int64(len(c.Scope.Method)) +
		int64(len(c.Scope.Route)) + int64(len(c.Scope.Key)) + int64(len(c.Fingerprint)) +
		int64(len(c.Owner)) + int64(len(c.Request))
	if size > s.cfg.maxRecord {
		return idempotency.ClaimResult{}, fmt.Errorf(
			"%w: a new record of %d bytes, at most %d (redisstore)",
			idempotency.ErrRecordTooLarge, size, s.cfg.maxRecord)
	}
	k := s.keysOf(c.Scope)
	lease := unixnano.Add(c.Now, c.LeaseFor)
	var cutoff any = "" // ReplayWindow <= 0: completed records never expire
	if c.ReplayWindow > 0 {
		cutoff = unixnano.Add(c.Now, -c.ReplayWindow)
	}
	takeoverOnly := "0"
	if c.TakeoverOnly {
		takeoverOnly = "1"
	}
	keep := keepFor(c)
	evicting := "0"
	if s.guard.evicting.Load() != nil {
		evicting = "1"
	}
	ctx, cancel := s.call(ctx)
	defer cancel()
	v, err := s.run(ctx, "claim", sc, []string{k.rec, k.lease, k.done, s.nonce(k), k.marker},
		claimWrote,
		c.Scope.Principal, c.Scope.Method, c.Scope.Route, c.Scope.Key,
		c.Fingerprint, c.FingerprintVersion, c.Owner, lease,
		c.Request, ns(c.Now), cutoff, takeoverOnly,
		k.member, lease/1000, max(c.LeaseFor.Milliseconds(), 0), keep.Milliseconds(),
		s.nonceTTL(), s.guard.epoch, unixnano.Add(c.Now, -keep), evicting)
	if err != nil {
		switch {
		case redis.HasErrorPrefix(err, "OOM"): // the first write of a new record failed
			full := fmt.Errorf("%w: %v", idempotency.ErrStoreFull, err)
			return idempotency.ClaimResult{}, &OpError{Op: "claim", Err: full}
		case redis.HasErrorPrefix(err, "FORGOTTEN"), redis.HasErrorPrefix(err, "QUARANTINED"):
			return idempotency.ClaimResult{}, s.guard.forgotten(err)
		case redis.HasErrorPrefix(err, "EVICTING"):
			return idempotency.ClaimResult{}, s.guard.refusedEviction()
		}
		var re *ReplicationError
		if !errors.As(err, &re) {
			return idempotency.ClaimResult{}, opErr("claim", err)
		}
		// Acquired but not replicated: the caller must not run.
		return idempotency.ClaimResult{}, err
	}
	res, err := claimResult(v, c, lease)
	if err != nil {
		return idempotency.ClaimResult{}, opErr("claim", err)
	}
	return res, nil
}

// keepFor is how long Redis keeps the record c creates once completed:
// its replay window plus the longer of its lease and minMargin, or the
// backstop for a claim with no window (ReplayWindow <= 0), whose records
// claims never restart.
func keepFor(c idempotency.Claim) time.Duration {
	if c.ReplayWindow <= 0 {
		return backstop
	}
	return addDur(c.ReplayWindow, max(c.LeaseFor, minMargin))
}

// addDur returns a + b for positive durations, saturating.
func addDur(a, b time.Duration) time.Duration {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// claimWrote reports whether the claim script's answer is of a claim that
// wrote.
func claimWrote(v any) bool {
	a, ok := v.([]any)
	if !ok || len(a) == 0 {
		return false
	}
	o, _ := a[0].(int64)
	return o != 0
}

// fencedWrote reports whether a fenced write's answer is 1.
func fencedWrote(v any) bool {
	n, _ := v.(int64)
	return n == 1
}

// claimResult reads the claim script's answer (see claimScript) to c, whose
// lease ends at lease (ns).
func claimResult(v any, c idempotency.Claim, lease int64) (
	idempotency.ClaimResult, error) {
	a, ok := v.([]any)
	if !ok || len(a) == 0 {
		return idempotency.ClaimResult{}, errCorrupt
	}
	outcome, _ := a[0].(int64)
	var r idempotency.Record
	var d decoder
	switch {
	case outcome == 0 && len(a) == 1:
		return idempotency.ClaimResult{}, nil // TakeoverOnly, nothing to take over
	case outcome == 0 && len(a) == 11:
		r = idempotency.Record{
			Scope: c.Scope, State: idempotency.State(d.int(a[1])), Fingerprint: d.str(a[2]),
			FingerprintVersion: int(d.int(a[3])), Owner: d.str(a[4]), Generation: d.int(a[5]),
			LeaseUntil: unixnano.Time(d.int(a[6])), CompletedAt: unixnano.Time(d.optInt(a[7])),
		}
		if r.State == idempotency.Completed {
			r.Response = d.response(a[8], a[9], a[10])
		}
		if d.err != nil {
			return idempotency.ClaimResult{}, d.err
		}
		return idempotency.ClaimResult{Outcome: idempotency.ClaimExisting, Record: r}, nil
	case (outcome == 1 && len(a) == 2) || (outcome == 2 && len(a) == 6):
	default:
		return idempotency.ClaimResult{}, errCorrupt
	}
	now := unixnano.Time(unixnano.Of(c.Now))
	r = idempotency.Record{
		Scope: c.Scope, State: idempotency.InProgress, Fingerprint: c.Fingerprint,
		FingerprintVersion: c.FingerprintVersion, Owner: c.Owner, Generation: d.int(a[1]),
		LeaseUntil: unixnano.Time(lease), CreatedAt: now, UpdatedAt: now,
	}
	if outcome == 1 {
		r.Request = c.Request
		return idempotency.ClaimResult{Outcome: idempotency.ClaimCreated, Record: r}, d.err
	}
	r.RecoveryPoint = d.str(a[2])
	r.RecoveryData = d.bytes(a[3])
	r.Request = d.bytes(a[4])
	r.CreatedAt = unixnano.Time(d.int(a[5]))
	return idempotency.ClaimResult{Outcome: idempotency.ClaimTakenOver, Record: r}, d.err
}

// decoder reads the values of a script's answer; after the first error
// every read returns a zero value and err stays set.
type decoder struct{ err error }

// value returns v as a string, and false for a missing field (nil, or
// false under RESP3).
func value(v any) (string, bool) {
	switch v := v.(type) {
	case string:
		return v, true
	case int64:
		return strconv.FormatInt(v, 10), true
	}
	return "", false
}

func (d *decoder) str(v any) string {
	s, _ := value(v)
	return s
}

// bytes returns v's bytes, nil for a missing or empty field.
func (d *decoder) bytes(v any) []byte {
	s, ok := value(v)
	if !ok || s == "" {
		return nil
	}
	return []byte(s)
}

func (d *decoder) int(v any) int64 {
	if n, ok := v.(int64); ok {
		return n
	}
	s, ok := value(v)
	if !ok {
		if d.err == nil {
			d.err = errCorrupt
		}
		return 0
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil && d.err == nil {
		d.err = errCorrupt
	}
	return n
}

// optInt reads a field that may be missing (0).
func (d *decoder) optInt(v any) int64 {
	if _, ok := value(v); !ok {
		return 0
	}
	return d.int(v)
}

func (d *decoder) response(status, header, body any) *idempotency.Response {
	resp := &idempotency.Response{Status: int(d.int(status)), Body: d.bytes(body)}
	if h, ok := value(header); ok {
		var err error
		// An empty field converts to an empty, non-nil slice: Decode refuses it.
		if resp.Header, err = headercodec.Decode([]byte(h)); err != nil && d.err == nil {
			d.err = err
		}
	}
	return resp
}

// pairs reads the answer of an HGETALL made in a script: a flat list of
// fields and values under RESP2 and RESP3 alike (a map, if a client ever
// hands one over).
func pairs(v any) (map[string]string, error) {
	switch v := v.(type) {
	case nil:
		return nil, nil
	case []any:
		if len(v)%2 != 0 {
			return nil, errCorrupt
		}
		m := make(map[string]string, len(v)/2)
		for i := 0; i < len(v); i += 2 {
			k, _ := value(v[i])
			val, _ := value(v[i+1])
			m[k] = val
		}
		return m, nil
	case map[any]any:
		m := make(map[string]string, len(v))
		for k, val := range v {
			ks, _ := value(k)
			m[ks], _ = value(val)
		}
		return m, nil
	}
	return nil, errCorrupt
}

// recordOf reads a record's hash (HGETALL).
func recordOf(m map[string]string) (idempotency.Record, error) {
	var d decoder
	get := func(f string) any {
		if v, ok := m[f]; ok {
			return v
		}
		return nil
	}
	r := idempotency.Record{
		Scope: idempotency.Scope{
			Principal: m["p"], Method: m["m"], Route: m["u"], Key: m["k"],
		},
		State:              idempotency.State(d.int(get("st"))),
		Fingerprint:        m["fp"],
		FingerprintVersion: int(d.int(get("fv"))),
		Owner:              m["o"],
		Generation:         d.int(get("g")),
		LeaseUntil:         unixnano.Time(d.int(get("lu"))),
		RecoveryPoint:      m["rp"],
		RecoveryData:       d.bytes(get("rd")),
		Request:            d.bytes(get("rq")),
		CreatedAt:          unixnano.Time(d.int(get("ca"))),
		CompletedAt:        unixnano.Time(d.optInt(get("co"))),
	}
	switch _, updated := m["ua"]; {
	case r.State == idempotency.Completed:
		r.UpdatedAt = r.CompletedAt // a completed record's last update
	case updated:
		r.UpdatedAt = unixnano.Time(d.int(get("ua")))
	default:
		r.UpdatedAt = r.CreatedAt // never updated since its creation
	}
	if r.State != idempotency.InProgress && r.State != idempotency.Completed && d.err == nil {
		d.err = errCorrupt
	}
	if r.State == idempotency.Completed {
		r.Response = d.response(get("rs"), get("rh"), get("rb"))
	}
	return r, d.err
}

// Get implements idempotency.Store.Get with one script (an HGETALL on the
// primary, whatever replicas the client reads from). It returns
// idempotency.ErrNotFound when no record exists, *OpError with Op "get"
// otherwise.
func (s *Store) Get(ctx context.Context, sc idempotency.Scope) (idempotency.Record, error) {
	ctx, cancel := s.call(ctx)
	defer cancel()
	v, err := getScript.Run(ctx, s.rdb, []string{s.keysOf(sc).rec}).Result()
	if err != nil && err != redis.Nil {
		return idempotency.Record{}, opErr("get", err)
	}
	m, err := pairs(v)
	if err != nil {
		return idempotency.Record{}, opErr("get", err)
	}
	if len(m) == 0 {
		return idempotency.Record{}, idempotency.ErrNotFound
	}
	rec, err := recordOf(m)
	if err == nil && rec.Scope != sc {
		err = errScopeMismatch
	}
	if err != nil {
		return idempotency.Record{}, opErr("get", err)
	}
	return rec, nil
}

// fenced runs a fenced write and turns its answer into nil or
// idempotency.ErrLeaseLost.
func (s *Store) fenced(ctx context.Context, op string, sc *redis.Script, k []string,
	args ...any) error {
	ctx, cancel := s.call(ctx)
	defer cancel()
	v, err := s.run(ctx, op, sc, k, fencedWrote, args...)
	if err != nil {
		return opErr(op, err)
	}
	if !fencedWrote(v) {
		return idempotency.ErrLeaseLost
	}
	return nil
}

// Heartbeat implements idempotency.Store.Heartbeat: it sets the lease end
// to until. idempotency.ErrLeaseLost when l does not own an in-progress
// record.
func (s *Store) Heartbeat(ctx context.Context, l idempotency.Lease, until time.Time) error {
	return s.lease(ctx, "heartbeat", l, until)
}

func (s *Store) lease(ctx context.Context, op string, l idempotency.Lease, until time.Time) error {
	k := s.keysOf(l.Scope)
	return s.fenced(ctx, op, heartbeatScript, []string{k.rec, k.lease, s.nonce(k)},
		l.Owner, l.Generation, ns(until), micros(until), k.member, s.nonceTTL())
}

// Complete implements idempotency.Store.Complete: it stores resp, drops the
// stored request and sets the record's time to live: its claim's replay
// window and margin (see the package documentation).
// idempotency.ErrLeaseLost when l does not own an in-progress record. A
// retry of the same call after a lost reply succeeds.
func (s *Store) Complete(ctx context.Context, l idempotency.Lease, resp idempotency.Response,
	now time.Time) error {
	k := s.keysOf(l.Scope)
	header, hasHeader := headercodec.Encode(resp.Header), "0" // nil for a nil header
	if header != nil {
		hasHeader = "1"
	}
	return s.fenced(ctx, "complete", completeScript, []string{k.rec, k.lease, k.done, s.nonce(k)},
		l.Owner, l.Generation, resp.Status, header, hasHeader, resp.Body, ns(now), k.member,
		micros(now), s.nonceTTL())
}

// Release implements idempotency.Store.Release: it deletes the in-progress
// record l owns. idempotency.ErrLeaseLost when l does not own it (also for
// a retry of a release whose reply was lost: the record is gone).
func (s *Store) Release(ctx context.Context, l idempotency.Lease) error {
	k := s.keysOf(l.Scope)
	return s.fenced(ctx, "release", releaseScript, []string{k.rec, k.lease, s.nonce(k)},
		l.Owner, l.Generation, k.member, s.nonceTTL())
}

// SetRecoveryPoint implements idempotency.Store.SetRecoveryPoint.
// idempotency.ErrLeaseLost when l does not own an in-progress record.
func (s *Store) SetRecoveryPoint(ctx context.Context, l idempotency.Lease, point string,
	data []byte, now time.Time) error {
	k := s.keysOf(l.Scope)
	hasData := "0"
	if data != nil {
		hasData = "1"
	}
	return s.fenced(ctx, "set_recovery_point", pointScript, []string{k.rec, s.nonce(k)},
		l.Owner, l.Generation, point, data, hasData, ns(now), s.nonceTTL())
}
