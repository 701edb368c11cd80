package redisstore

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/unixnano"
)

// candidate is an index member found by a listing: its shard and score.
type candidate struct {
	shard  int
	member string
	score  float64
}

// leaseIndex and doneIndex name a shard's indexes, for scan.
func leaseIndex(k *shardKeys) string { return k.lease }
func doneIndex(k *shardKeys) string  { return k.done }

// scan lists, in every shard's index that index names, up to limit members
// scored at most below (µs), in one pipelined round, the lowest scores
// first.
func (s *Store) scan(ctx context.Context, index func(*shardKeys) string, below int64,
	limit int) ([]candidate, error) {
	ctx, cancel := s.call(ctx)
	defer cancel()
	cmds := make([]*redis.ZSliceCmd, shards)
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range shards {
			cmds[i] = p.ZRangeArgsWithScores(ctx, redis.ZRangeArgs{
				Key: index(&s.shards[i]), Start: "-inf", Stop: below, ByScore: true,
				Count: int64(limit),
			})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []candidate
	for i, c := range cmds {
		for _, z := range c.Val() {
			m, _ := z.Member.(string)
			out = append(out, candidate{shard: i, member: m, score: z.Score})
		}
	}
	slices.SortFunc(out, func(a, b candidate) int { return cmp.Compare(a.score, b.score) })
	return out, nil
}

// scripts runs sc once per candidate on its keys, with args before the
// member, in one pipelined round (the scripts loaded first where a primary
// lacks them).
func (s *Store) scripts(ctx context.Context, sc *redis.Script, cs []candidate, args ...any) (
	[]*redis.Cmd, error) {
	ctx, cancel := s.call(ctx)
	defer cancel()
	type evalFunc func(p redis.Pipeliner, k []string, a ...any) *redis.Cmd
	pipe := func(eval evalFunc) ([]*redis.Cmd, error) {
		cmds := make([]*redis.Cmd, len(cs))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, c := range cs {
				k := s.keysFor(c.shard, c.member)
				a := append(args[:len(args):len(args)], c.member)
				cmds[i] = eval(p, []string{k.rec, k.lease, k.done}, a...)
			}
			return nil
		})
		if errors.Is(err, redis.Nil) { // a record gone: fetched reads it
			err = nil
		}
		return cmds, err
	}
	cmds, err := pipe(func(p redis.Pipeliner, k []string, a ...any) *redis.Cmd {
		return sc.EvalSha(ctx, p, k, a...)
	})
	if err != nil && len(cmds) > 0 && redis.HasErrorPrefix(firstErr(cmds), "NOSCRIPT") {
		cmds, err = pipe(func(p redis.Pipeliner, k []string, a ...any) *redis.Cmd {
			return sc.Eval(ctx, p, k, a...)
		})
	}
	if err != nil {
		return nil, err
	}
	return cmds, nil
}

func firstErr(cmds []*redis.Cmd) error {
	for _, c := range cmds {
		if err := c.Err(); err != nil {
			return err
		}
	}
	return nil
}

// Abandoned implements idempotency.Sweeper.Abandoned: up to limit in-progress
// records whose lease ended before now, the longest-expired first, then
// the oldest. It lists every shard's lease index in one pipelined round and
// reads the records found in another (per primary on a Cluster); members of
// records that Redis expired leave the index on the way. A limit of 0 or
// less returns nothing. Errors are *OpError with Op "abandoned".
func (s *Store) Abandoned(ctx context.Context, now time.Time, limit int) (
	[]idempotency.Record, error) {
	if limit <= 0 {
		return nil, nil
	}
	cs, err := s.scan(ctx, leaseIndex, micros(now), limit)
	if err != nil {
		return nil, opErr("abandoned", err)
	}
	var out []idempotency.Record
	for len(cs) > 0 && len(out) < limit {
		batch := cs[:min(len(cs), limit-len(out))]
		cs = cs[len(batch):]
		cmds, err := s.scripts(ctx, fetchScript, batch)
		if err != nil {
			return nil, opErr("abandoned", err)
		}
		for _, c := range cmds {
			rec, ok, err := fetched(c)
			if err != nil {
				return nil, opErr("abandoned", err)
			}
			if ok && rec.State == idempotency.InProgress && rec.LeaseUntil.Before(now) {
				out = append(out, rec)
			}
		}
	}
	slices.SortFunc(out, func(a, b idempotency.Record) int {
		if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
			return c
		}
		return a.CreatedAt.Compare(b.CreatedAt)
	})
	return out, nil
}

// fetched reads a fetch script's answer: the record, or false when it is
// gone.
func fetched(c *redis.Cmd) (idempotency.Record, bool, error) {
	v, err := c.Result()
	if err == redis.Nil {
		return idempotency.Record{}, false, nil
	}
	if err != nil {
		return idempotency.Record{}, false, err
	}
	if _, gone := v.(bool); gone || v == nil {
		return idempotency.Record{}, false, nil // false (RESP3) or nil: gone
	}
	m, err := pairs(v)
	if err != nil {
		return idempotency.Record{}, false, err
	}
	rec, err := recordOf(m)
	return rec, err == nil, err
}

// DeleteBefore implements idempotency.Sweeper.DeleteBefore: up to limit
// records last updated before horizon that are completed or whose lease
// also ended before it. It lists every shard's indexes in one pipelined
// round (each shard at most max(8, 4 limit / 256) members, so a shard
// holding many more of the old records than its share waits for the next
// call) and deletes with one script per record, which checks the
// conditions again, so a record taken over, heartbeated or completed
// meanwhile survives. Redis expires records by itself (see the package
// documentation): this deletes those it still holds. A limit of 0 or less
// deletes nothing. Errors are *OpError with Op "delete_before".
func (s *Store) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	below := micros(horizon)
	// Records spread evenly over the shards (their digests decide): each
	// shard lists a share of the limit, with room for unevenness, rather
	// than the whole limit, which would list shards times the limit.
	per := min(limit, max(8, 4*limit/shards))
	done, err := s.scan(ctx, doneIndex, below, per)
	if err != nil {
		return 0, opErr("delete_before", err)
	}
	leased, err := s.scan(ctx, leaseIndex, below, per)
	if err != nil {
		return 0, opErr("delete_before", err)
	}
	cs := append(done, leased...)
	slices.SortFunc(cs, func(a, b candidate) int { return cmp.Compare(a.score, b.score) })
	deleted := 0
	h := strconv.FormatInt(unixnano.Of(horizon), 10)
	for len(cs) > 0 && deleted < limit {
		batch := cs[:min(len(cs), limit-deleted)]
		cs = cs[len(batch):]
		cmds, err := s.scripts(ctx, reapScript, batch, h)
		if err != nil {
			return deleted, opErr("delete_before", err)
		}
		for _, c := range cmds {
			if n, _ := c.Int64(); n == 1 {
				deleted++
			}
		}
	}
	return deleted, nil
}
