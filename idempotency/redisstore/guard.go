package redisstore

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/internal/unixnano"
)

// defaultCheckInterval is the period of the checks (WithCheckInterval).
const defaultCheckInterval = 10 * time.Second

// ErrForgotten is matched (errors.Is) by the *ForgottenError of a claim of
// a new key refused because Redis may have lost records.
var ErrForgotten = errors.New("redisstore: Redis may have lost records")

// ErrNoPersistence is matched by the *PersistenceError that New returns
// for a server that keeps nothing on disk.
var ErrNoPersistence = errors.New("redisstore: Redis keeps nothing on disk")

// ForgottenError is the refusal of a claim that would create a record in
// a shard whose Redis may have lost records: its marker was gone (a
// restart without persistence, a failover to an empty replica, FLUSHALL),
// armed again by another Store's New, or Redis evicted keys. The key's
// record may have been among them, and its request would run again, so
// the claim creates nothing; the middleware answers 503
// CodeStoreUnavailable. Claims of records Redis holds are answered. The
// refusals end with Rearm, or for each claim once its replay window and
// the longer of its lease and a minute have passed since Since (see the
// package documentation). It matches ErrForgotten.
type ForgottenError struct {
	// Since is when the loss was detected, by the clock of the
	// application server whose claim or check detected it.
	Since time.Time
}

// Error returns "redisstore: Redis may have lost records ...".
func (e *ForgottenError) Error() string {
	return "redisstore: Redis may have lost records (a restart without persistence, " +
		"a failover to an empty replica, FLUSHALL, an eviction), detected at " +
		e.Since.UTC().Format(time.RFC3339Nano) + ": new keys are refused until Rearm, " +
		"or until the replay window and the longer of the lease and a minute have passed"
}

// Is reports whether target is ErrForgotten.
func (e *ForgottenError) Is(target error) bool { return target == ErrForgotten }

// PersistenceError is New's refusal of a server that keeps nothing on disk
// (no RDB save point, appendonly no): a restart loses every record. It
// matches ErrNoPersistence. WithMemoryOnly accepts such a server.
type PersistenceError struct {
	Addr string // the server's address
}

// Error returns "redisstore: <addr> keeps nothing on disk ...".
func (e *PersistenceError) Error() string {
	return "redisstore: " + e.Addr + " keeps nothing on disk (no save point, appendonly no): " +
		"a restart loses every record; enable AOF or RDB, or accept it with WithMemoryOnly"
}

// Is reports whether target is ErrNoPersistence.
func (e *PersistenceError) Is(target error) bool { return target == ErrNoPersistence }

// guard keeps a Store's trust in what its Redis holds: the epoch of the
// markers (see scripts.go) the Store armed or found, the servers' settings
// as last checked, and the goroutine that checks them again every period
// and quarantines the shards that forgot. Claims read it and never wait
// for it.
type guard struct {
	rdb    redis.UniversalClient
	shards *[shards]shardKeys
	cfg    *config
	epoch  string
	// evicting is a server that may evict keys, as last checked: claims
	// of new keys are refused while it is set.
	evicting atomic.Pointer[EvictionPolicyError]
	wake     chan struct{} // a claim found a shard forgotten: check now
	base     context.Context
	stop     context.CancelFunc // ends base: the goroutine returns
	done     chan struct{}      // closed when it returned

	// The checks' own, touched by New and then by the goroutine only.
	evicted map[string]int64  // each server's evicted_keys when last checked
	logged  map[string]string // what was last logged of each subject
	owed    bool              // a server evicted keys: quarantine every shard
}

func newGuard(rdb redis.UniversalClient, sh *[shards]shardKeys, cfg *config) *guard {
	return &guard{rdb: rdb, shards: sh, cfg: cfg, wake: make(chan struct{}, 1),
		base: context.Background(), done: make(chan struct{}),
		evicted: map[string]int64{}, logged: map[string]string{}}
}

// start starts the goroutine of the checks; close stops it.
func (g *guard) start() {
	g.base, g.stop = context.WithCancel(context.Background())
	go g.run()
}

const msgHidden = "redisstore: cannot check maxmemory-policy and persistence " +
	"(CONFIG GET refused): make sure the policy is noeviction and the server persists"

// server is what a check read of one server.
type server struct {
	addr       string
	hidden     bool   // CONFIG GET refused: policy and persistence unknown
	policy     string // maxmemory-policy
	persistent bool   // a save point or appendonly yes
	evicted    int64  // evicted_keys, -1 unknown
	primary    bool
	replicas   int // connected_slaves of a primary
	err        error
}

// readServers reads the settings of every server the client reaches: the
// server of a *redis.Client (through Sentinel, the current primary), every
// primary and replica of a Cluster, every shard of a Ring, each in one
// round trip.
func (g *guard) readServers(ctx context.Context) ([]server, error) {
	var mu sync.Mutex
	var out []server
	read := func(ctx context.Context, c *redis.Client) error {
		sv := server{addr: c.Options().Addr, evicted: -1}
		var policy, save, aof *redis.MapStringStringCmd
		var info *redis.StringCmd
		_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
			policy = p.ConfigGet(ctx, "maxmemory-policy")
			save = p.ConfigGet(ctx, "save")
			aof = p.ConfigGet(ctx, "appendonly")
			info = p.Info(ctx, "stats", "replication")
			return nil
		})
		var rerr redis.Error
		switch err := policy.Err(); {
		case errors.As(err, &rerr):
			sv.hidden = true
		case err != nil:
			sv.err = err
		default:
			sv.policy = policy.Val()["maxmemory-policy"]
			sv.persistent = save.Val()["save"] != "" || aof.Val()["appendonly"] == "yes"
			if err := cmp.Or(save.Err(), aof.Err()); err != nil {
				sv.err = err
			}
		}
		if sv.err == nil && info.Err() == nil {
			for line := range strings.SplitSeq(info.Val(), "\r\n") {
				k, v, _ := strings.Cut(line, ":")
				switch k {
				case "evicted_keys":
					sv.evicted, _ = strconv.ParseInt(v, 10, 64)
				case "role":
					sv.primary = v == "master"
				case "connected_slaves":
					sv.replicas, _ = strconv.Atoi(v)
				}
			}
		}
		mu.Lock()
		out = append(out, sv)
		mu.Unlock()
		return nil
	}
	var err error
	switch c := g.rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachShard(ctx, read) // the replicas too: one may become a primary
	case *redis.Ring:
		err = c.ForEachShard(ctx, read)
	case *redis.Client:
		err = read(ctx, c)
	}
	slices.SortFunc(out, func(a, b server) int { return cmp.Compare(a.addr, b.addr) })
	return out, err
}

// checkNew is New's check of the servers: it refuses one that may evict
// keys or, without WithMemoryOnly, keeps nothing on disk, warns of one
// that hides its settings, and notes each server's evicted_keys.
func (g *guard) checkNew(ctx context.Context) error {
	servers, err := g.readServers(ctx)
	if err != nil {
		return &OpError{Op: "new", Err: err}
	}
	for _, sv := range servers {
		switch {
		case sv.err != nil:
			return &OpError{Op: "new", Err: fmt.Errorf("%s: %w", sv.addr, sv.err)}
		case sv.hidden:
			g.change(sv.addr+" hidden", slog.LevelWarn, "true", msgHidden, "addr", sv.addr)
		case sv.policy != "noeviction":
			return &EvictionPolicyError{Addr: sv.addr, Policy: sv.policy}
		case !sv.persistent && !g.cfg.memoryOnly:
			return &PersistenceError{Addr: sv.addr}
		}
		g.evicted[sv.addr] = sv.evicted
	}
	return nil
}

// check is the periodic check of the servers and the markers. A server
// that may evict keys refuses claims of new keys until a check finds it at
// noeviction again; a server that evicted keys since the last check
// quarantines every shard; a server that keeps nothing on disk any more,
// or a primary with fewer replicas than WithReplicas asks for, is logged.
// Each finding is logged when it changes.
func (g *guard) check(ctx context.Context, now time.Time) {
	servers, err := g.readServers(ctx)
	if g.base.Err() != nil {
		return // closed
	}
	g.change("servers", slog.LevelWarn, errText(err),
		"redisstore: the check of the servers failed", "err", err)
	var evicting *EvictionPolicyError
	evicted := ""
	for _, sv := range servers {
		g.change(sv.addr+" read", slog.LevelWarn, errText(sv.err),
			"redisstore: cannot check a server", "addr", sv.addr, "err", sv.err)
		if sv.err != nil {
			continue
		}
		g.change(sv.addr+" hidden", slog.LevelWarn, strconv.FormatBool(sv.hidden), msgHidden,
			"addr", sv.addr)
		if !sv.hidden && sv.policy != "noeviction" && evicting == nil {
			evicting = &EvictionPolicyError{Addr: sv.addr, Policy: sv.policy}
		}
		if !sv.hidden && !g.cfg.memoryOnly {
			g.change(sv.addr+" persistence", slog.LevelError, strconv.FormatBool(!sv.persistent),
				"redisstore: the server keeps nothing on disk: a restart will lose its records, "+
					"and claims of new keys in them will be refused until Rearm", "addr", sv.addr)
		}
		if sv.primary && g.cfg.replicas > 0 {
			short := strconv.FormatBool(sv.replicas < g.cfg.replicas)
			g.change(sv.addr+" replicas", slog.LevelWarn, short,
				"redisstore: a primary has fewer replicas than WithReplicas asks for: "+
					"its writes fail until a replica is attached", "addr", sv.addr,
				"replicas", sv.replicas, "want", g.cfg.replicas)
		}
		if last, ok := g.evicted[sv.addr]; ok && last >= 0 && sv.evicted > last {
			evicted = sv.addr
		}
		g.evicted[sv.addr] = sv.evicted
	}
	if err == nil || len(servers) > 0 {
		g.evicting.Store(evicting)
		what := ""
		if evicting != nil {
			what = evicting.Addr + " " + evicting.Policy
		}
		g.change("evicting", slog.LevelError, what,
			"redisstore: a server may evict keys: claims of new keys are refused "+
				"until its maxmemory-policy is noeviction", "err", evicting)
	}
	if evicted != "" {
		g.log(slog.LevelError, "redisstore: a server evicted keys: every shard is quarantined",
			"addr", evicted)
		g.owed = true
	}
	err = g.sweep(ctx, now, g.owed, nil)
	if err == nil {
		g.owed = false
	} else if g.base.Err() == nil {
		g.log(slog.LevelWarn, "redisstore: the check of the markers failed", "err", err)
	}
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// arm finds the epoch of the prefix's markers, arming them when the
// prefix is new, and quarantines the shards that forgot (sweep). A prefix
// is new when no shard holds a marker: New puts "p" and an epoch of its
// own on shard 0 unless another New was first, then that epoch ("n") on
// every shard that holds none, and turns shard 0's into "n" (finishArm; a
// New that finds shard 0 at "p" finishes that arming). It reads the other
// shards before shard 0, so that a shard 0 without a marker while another
// holds one means that shard 0 forgot, not that an arming is under way.
// The epoch is shard 0's, or the one most shards hold when shard 0 holds
// none of an epoch.
func (g *guard) arm(ctx context.Context, now time.Time) error {
	marks, err := g.markers(ctx, 1, shards)
	if err != nil {
		return err
	}
	first, err := g.markers(ctx, 0, 1)
	if err != nil {
		return err
	}
	marks[0] = first[0]
	fresh := !slices.ContainsFunc(marks, func(m string) bool { return m != "" })
	if fresh {
		var mine [8]byte
		_, _ = rand.Read(mine[:])
		epoch := hex.EncodeToString(mine[:])
		set, err := g.rdb.SetNX(ctx, g.shards[0].marker, "p"+epoch, 0).Result()
		if err != nil {
			return err
		}
		if !set { // another New was first: read its marker
			if first, err = g.markers(ctx, 0, 1); err != nil {
				return err
			}
			marks[0] = first[0]
		} else {
			marks[0] = "p" + epoch
			g.log(slog.LevelInfo, "redisstore: arming a new prefix (no shard held a marker)",
				"prefix", g.cfg.prefix)
		}
	}
	if m := marks[0]; strings.HasPrefix(m, "p") {
		if err := g.finishArm(ctx, m[1:]); err != nil {
			return err
		}
		fresh = true // the markers changed: sweep reads them again
	}
	g.epoch = epochOf(marks)
	if fresh {
		marks = nil
	}
	return g.sweep(ctx, now, false, marks)
}

// finishArm writes "n" and epoch on every shard but 0 that holds no
// marker, then turns shard 0's "p" into "n".
func (g *guard) finishArm(ctx context.Context, epoch string) error {
	_, err := g.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := 1; i < shards; i++ {
			p.SetNX(ctx, g.shards[i].marker, "n"+epoch, 0)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return finishArmScript.Run(ctx, g.rdb, []string{g.shards[0].marker}, epoch).Err()
}

// epochOf returns shard 0's epoch when it holds one ("n" or "p"), else the
// epoch most shards hold, else "".
func epochOf(marks []string) string {
	if k := marks[0]; k != "" && (k[0] == 'n' || k[0] == 'p') {
		return k[1:]
	}
	count := map[string]int{}
	best := ""
	for _, m := range marks {
		if m == "" || m[0] != 'n' {
			continue
		}
		e := m[1:]
		count[e]++
		if count[e] > count[best] || (count[e] == count[best] && e < best) {
			best = e
		}
	}
	return best
}

// markers reads the markers of the shards from `from` to `to` (excluded),
// on their primaries, in one pipelined round (per primary on a Cluster):
// "" for a shard that holds none.
func (g *guard) markers(ctx context.Context, from, to int) ([]string, error) {
	cmds := make([]*redis.Cmd, shards)
	_, _ = g.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := from; i < to; i++ {
			cmds[i] = markerScript.Eval(ctx, p, []string{g.shards[i].marker})
		}
		return nil
	})
	out := make([]string, shards)
	for i := from; i < to; i++ {
		v, err := cmds[i].Text()
		if err != nil && err != redis.Nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// sweep quarantines every shard whose marker does not vouch for it (all of
// them with force), checking each again inside a script, and logs what it
// quarantined and, when it changed, how many shards are quarantined. It
// reads the markers, unless given them (marks, read a moment ago).
func (g *guard) sweep(ctx context.Context, now time.Time, force bool, marks []string) error {
	var err error
	if marks == nil {
		if marks, err = g.markers(ctx, 0, shards); err != nil {
			return err
		}
	}
	var suspects []int
	quarantined := 0
	for i, m := range marks {
		switch {
		case strings.HasPrefix(m, "q"):
			quarantined++
		case force || !trusted(m, g.epoch):
			suspects = append(suspects, i)
		}
	}
	if len(suspects) > 0 {
		flag := "0"
		if force {
			flag = "1"
		}
		cmds := make([]*redis.Cmd, len(suspects))
		_, err = g.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for j, i := range suspects {
				cmds[j] = quarantineScript.Eval(ctx, p, []string{g.shards[i].marker},
					g.epoch, ns(now), flag)
			}
			return nil
		})
		if err != nil {
			return err
		}
		fresh := 0
		for _, c := range cmds {
			switch n, _ := c.Int64(); n {
			case 1:
				fresh++
				quarantined++
			case 2:
				quarantined++
			}
		}
		if fresh > 0 {
			g.log(slog.LevelError, "redisstore: Redis lost records: shards without their marker "+
				"(a restart without persistence, a failover to an empty replica, FLUSHALL), "+
				"armed again by another Store's New, or evicted are quarantined: claims of new "+
				"keys in them are refused until Rearm, or until the replay window and the longer "+
				"of the lease and a minute have passed", "shards", fresh, "detected", now)
		}
	}
	g.change("quarantined", slog.LevelWarn, strconv.Itoa(quarantined),
		"redisstore: shards quarantined: claims of new keys in them are refused",
		"shards", quarantined, "of", shards)
	return nil
}

// trusted is the scripts' trusted (scripts.go): whether marker m vouches
// for its shard to the Store of epoch e.
func trusted(m, e string) bool {
	if m == "" {
		return false
	}
	return m[0] == 'r' || ((m[0] == 'n' || m[0] == 'p') && m[1:] == e)
}

// forgotten returns the refusal of a claim whose script answered that its
// shard may have forgotten (FORGOTTEN or QUARANTINED and the time of the
// detection); a claim that detected it logs it and wakes the check, which
// quarantines the other shards that forgot.
func (g *guard) forgotten(err error) error {
	kind, at, _ := strings.Cut(err.Error(), " ")
	n, perr := strconv.ParseInt(at, 10, 64)
	if perr != nil {
		return &OpError{Op: "claim", Err: errCorrupt}
	}
	fe := &ForgottenError{Since: unixnano.Time(n)}
	if kind == "FORGOTTEN" {
		g.log(slog.LevelError, "redisstore: a claim found its shard without its marker, or "+
			"armed by another Store's New: Redis lost records, and the shard is quarantined",
			"err", fe)
		select {
		case g.wake <- struct{}{}:
		default:
		}
	}
	return &OpError{Op: "claim", Err: fe}
}

// refusedEviction returns the refusal of a claim answered EVICTING.
func (g *guard) refusedEviction() error {
	if e := g.evicting.Load(); e != nil {
		return &OpError{Op: "claim", Err: e}
	}
	return &OpError{Op: "claim", Err: ErrEvictionPolicy}
}

// run checks every period until close, and at once when a claim wakes it.
// Each check has the deadline of one call (WithTimeout).
func (g *guard) run() {
	defer close(g.done)
	t := time.NewTicker(g.cfg.checkEvery)
	defer t.Stop()
	for {
		select {
		case <-g.base.Done():
			return
		case <-t.C:
		case <-g.wake:
		}
		ctx, cancel := context.WithTimeout(g.base, g.cfg.timeout)
		g.check(ctx, time.Now())
		cancel()
	}
}

// close stops the goroutine and waits for it: at once, or when the check
// under way ends, within its deadline (WithTimeout: go-redis does not cut
// a call when its context is canceled, only at its deadline).
func (g *guard) close() {
	g.stop()
	<-g.done
}

// change logs msg at level when what differs from what was last logged of
// subject (and what is not empty, or "false", or "0" the first time).
func (g *guard) change(subject string, level slog.Level, what, msg string, args ...any) {
	last, seen := g.logged[subject]
	g.logged[subject] = what
	quiet := what == "" || what == "false" || what == "0"
	if (seen && last == what) || (!seen && quiet) {
		return
	}
	if quiet {
		g.log(slog.LevelInfo, msg+": no more", args...)
		return
	}
	g.log(level, msg, args...)
}

func (g *guard) log(level slog.Level, msg string, args ...any) {
	if g.cfg.logger != nil {
		g.cfg.logger.Log(context.Background(), level, msg, args...)
	}
}
