package redisstore

import (
	"strconv"

	"github.com/redis/go-redis/v9"
)

// The scripts. Each runs on the keys of one record, which share one hash
// tag and so one slot: the record's hash, its shard's lease index (a
// sorted set of the shard's records in progress, scored by lease end in
// microseconds), its shard's done index (of its completed records, scored
// by completion time in microseconds) and, for a write, its nonce's key.
// Times in the record are decimal Unix nanoseconds, compared as strings by
// lt (Lua numbers are doubles, exact only to 2^53). A script answers 0
// where the fence (owner, generation, in progress) does not hold, and
// writes nothing then.
//
// The record's fields: st the state (1 in progress, 2 completed); p, m, u,
// k the scope; fp, fv the fingerprint and its version; o, g the owner and
// generation; lu the lease end; ca the creation. In progress also: rq the
// stored request, w (below), ua the last update (absent until the first:
// ca), and rp, rd the recovery point and its data once set. Completed
// also: co the completion, rs, rh, rb the response's status, header and
// body (rh absent for a nil header); rp and rd are kept.
//
// The claim has no flags, so that on a Redis over maxmemory its first
// write fails and it writes nothing (the store answers ErrStoreFull for a
// new record; a takeover's failure it reports as TAKEOVER, since
// ErrStoreFull is for new keys only); the others are allow-oom: a
// completion, a heartbeat, a recovery point or a release of a record that
// exists is never refused for lack of memory.

// Expiry. A record in progress holds "w", how long Redis keeps it once
// completed (see keepFor). A write sets its time to live (PEXPIRE, counted
// by Redis from when it ran the write): a completed record w, a record in
// progress its lease's remaining time plus w plus the backstop, so that a
// Reaper has a month past the replay window to report it unfinished.
var luaBackstop = `
local backstop = ` + strconv.FormatInt(backstop.Milliseconds(), 10) + `
`

// lt compares two decimal integers (no leading zeros, an optional minus).
const luaLess = `
local function lt(a, b)
  local na, nb = a:sub(1, 1) == '-', b:sub(1, 1) == '-'
  if na ~= nb then return na end
  if na then a, b = b:sub(2), a:sub(2) end
  if #a ~= #b then return #a < #b end
  return a < b
end
`

// Every write records its answer under its call's nonce, a key of its own
// in the record's slot that expires after twice the call's deadline
// (WithTimeout): go-redis sends a call again, on a fresh connection, when
// the connection it went out on failed, which can happen after Redis ran
// it. A call that finds its nonce's key ran before, and answers what it
// did then, whatever the record went through since.

// Markers. Each shard holds a marker, a key with no expiry in its slot,
// that vouches that Redis still holds every record written to the shard:
// "n" and the epoch of the Store whose New armed a new prefix ("p" and the
// epoch on shard 0 while that arming is under way), "r" and a time once an
// operator re-armed it (Rearm), or "q" and the time (ns) a loss was
// detected (quarantined). Redis loses the marker with the records (a
// restart without persistence, a failover to an empty replica, FLUSHALL),
// and another Store's New that finds the prefix empty arms it under
// another epoch: either way a Store that armed or found its own epoch
// sees that the shard forgot. trusted reports whether marker m vouches for
// the shard to the Store of epoch e.
const luaTrusted = `
local function trusted(m, e)
  if not m then return false end
  local kind = m:sub(1, 1)
  return kind == 'r' or ((kind == 'n' or kind == 'p') and m:sub(2) == e)
end
`

// claimScript decides a claim. KEYS: record, lease index, done index, the
// call's nonce, the shard's marker. ARGV: 1-4 principal, method, route,
// key; 5 fingerprint; 6 its version; 7 owner; 8 lease end (ns); 9 request;
// 10 now (ns); 11 the replay cutoff (ns; "" when completed records never
// expire); 12 "1" for TakeoverOnly; 13 the index member; 14 the lease score
// (µs); 15 the lease (ms); 16 w, the keep of a new record (ms); 17 the
// nonce's expiry (ms); 18 the Store's epoch; 19 the quarantine cutoff (ns:
// a quarantine detected before it is over for this claim); 20 "1" while a
// server of the Store may evict keys.
//
// It answers {0} (nothing to take over), {0, st, fp, fv, owner, gen, lu,
// co, rs, rh, rb} (existing), {1, gen} (created) or {2, gen, rp, rd, rq, ca}
// (taken over), from one read of the record. A creation writes the whole
// hash at once (a restart past the window replaces it). The nonce's key
// holds "c" or "t" and the generation. A claim sent again answers {1, gen}
// again for a record it created; for a takeover it answers the record as
// it is while the record is still its, and an error (RETRY) once another
// claim took it: what it found then is gone.
//
// Only the creation of a record absent from Redis depends on what Redis
// may have forgotten: a record it holds is answered, taken over or
// restarted past its window as it is. So a claim that would create one
// first checks the shard's marker, read with the nonce (guard): it answers an error, EVICTING
// while a server may evict keys, FORGOTTEN and the time when the marker is
// gone or armed by another Store's New (the claim quarantines the shard:
// the write may fail on a Redis over its maxmemory, and the Store's check
// quarantines it then), or QUARANTINED and the time of the detection, and
// creates nothing.
var claimLua = luaLess + luaBackstop + luaTrusted + `
local rec, lease, done, nonce, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local f = redis.call('HMGET', rec, 'st', 'p', 'm', 'u', 'k', 'fp', 'fv', 'o', 'g', 'lu', 'co', 'w',
  'rs', 'rh', 'rb')
local st = f[1]

local function taken()
  local t = redis.call('HMGET', rec, 'g', 'rp', 'rd', 'rq', 'ca')
  return {2, t[1], t[2], t[3], t[4], t[5]}
end

-- The nonce and the marker in one read: every claim reads the nonce, and
-- a claim that creates a record needs the marker.
local nm = redis.call('MGET', nonce, marker)
local prior, m = nm[1], nm[2]
if prior then
  if prior:sub(1, 1) == 'c' then return {1, tonumber(prior:sub(2))} end
  if st == '1' and f[8] == ARGV[7] and f[9] == prior:sub(2) then return taken() end
  return redis.error_reply('RETRY the record changed between this takeover and its retry')
end

local function create(g)
  if g > 1 then
    redis.call('DEL', rec)
    redis.call('ZREM', done, ARGV[13])
  end
  redis.call('HSET', rec, 'st', '1', 'p', ARGV[1], 'm', ARGV[2], 'u', ARGV[3], 'k', ARGV[4],
    'fp', ARGV[5], 'fv', ARGV[6], 'o', ARGV[7], 'g', g, 'lu', ARGV[8], 'rq', ARGV[9],
    'ca', ARGV[10], 'w', ARGV[16])
  redis.call('PEXPIRE', rec, tonumber(ARGV[15]) + tonumber(ARGV[16]) + backstop)
  redis.call('ZADD', lease, ARGV[14], ARGV[13])
  redis.call('SET', nonce, 'c' .. g, 'PX', ARGV[17])
  return {1, g}
end

local function guard()
  if ARGV[20] == '1' then return 'EVICTING a server may evict keys' end
  if trusted(m, ARGV[18]) then return nil end
  if m and m:sub(1, 1) == 'q' then
    if lt(m:sub(2), ARGV[19]) then return nil end
    return 'QUARANTINED ' .. m:sub(2)
  end
  redis.pcall('SET', marker, 'q' .. ARGV[10])
  return 'FORGOTTEN ' .. ARGV[10]
end

if not st then
  if ARGV[12] == '1' then return {0} end
  local refused = guard()
  if refused then return redis.error_reply(refused) end
  return create(1)
end
if f[2] ~= ARGV[1] or f[3] ~= ARGV[2] or f[4] ~= ARGV[3] or f[5] ~= ARGV[4] then
  return redis.error_reply('SCOPE the record under this digest holds another scope')
end
if st == '2' and ARGV[12] ~= '1' and ARGV[11] ~= '' and lt(f[11], ARGV[11]) then
  return create(tonumber(f[9]) + 1)
end
if st == '1' and lt(f[10], ARGV[10]) and f[6] == ARGV[5] and f[7] == ARGV[6] then
  local g = tonumber(f[9]) + 1
  local w = redis.pcall('HSET', rec, 'o', ARGV[7], 'g', g, 'lu', ARGV[8], 'ua', ARGV[10])
  if type(w) == 'table' and w.err then
    return redis.error_reply('TAKEOVER ' .. w.err)
  end
  redis.call('PEXPIRE', rec, tonumber(ARGV[15]) + (tonumber(f[12]) or 0) + backstop)
  redis.call('ZADD', lease, ARGV[14], ARGV[13])
  redis.call('SET', nonce, 't' .. g, 'PX', ARGV[17])
  return taken()
end
return {0, st, f[6], f[7], f[8], f[9], f[10], f[11], f[13], f[14], f[15]}
`

var claimScript = redis.NewScript(claimLua)

// completeScript completes a record. KEYS: record, lease index, done
// index, the call's nonce. ARGV: 1 owner; 2 generation; 3 status; 4
// header; 5 "1" when there is a header; 6 body; 7 now (ns); 8 the index
// member; 9 the done score (µs); 10 the nonce's expiry (ms).
//
// It writes the completed record afresh, with only what a completed
// record is read for (no request, no w, no ua: its last update is its
// completion), so that a record of small values takes Redis's compact
// encoding whatever its request held. The record expires w after the
// completion; the shard's done index loses the members completed more
// than w ago, whose records Redis has dropped (for records of w's policy).
var completeScript = redis.NewScript(`#!lua flags=allow-oom
local rec, lease, done, nonce = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('EXISTS', nonce) == 1 then return 1 end
local f = redis.call('HMGET', rec, 'st', 'o', 'g', 'w', 'p', 'm', 'u', 'k', 'fp', 'fv', 'lu', 'ca',
  'rp', 'rd')
if f[1] ~= '1' or f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then return 0 end
local h = {'st', '2', 'p', f[5], 'm', f[6], 'u', f[7], 'k', f[8], 'fp', f[9], 'fv', f[10],
  'o', f[2], 'g', f[3], 'lu', f[11], 'ca', f[12], 'co', ARGV[7], 'rs', ARGV[3], 'rb', ARGV[6]}
if ARGV[5] == '1' then h[#h + 1], h[#h + 2] = 'rh', ARGV[4] end
if f[13] then h[#h + 1], h[#h + 2] = 'rp', f[13] end
if f[14] then h[#h + 1], h[#h + 2] = 'rd', f[14] end
redis.call('DEL', rec)
redis.call('HSET', rec, unpack(h))
redis.call('PEXPIRE', rec, f[4])
redis.call('ZREM', lease, ARGV[8])
redis.call('ZADD', done, ARGV[9], ARGV[8])
redis.call('ZREMRANGEBYSCORE', done, '-inf',
  '(' .. string.format('%.0f', tonumber(ARGV[9]) - 1000 * tonumber(f[4])))
redis.call('SET', nonce, '1', 'PX', ARGV[10])
return 1
`)

// heartbeatScript sets the lease end (Heartbeat). KEYS: record,
// lease index, the call's nonce. ARGV: 1 owner; 2 generation; 3 lease end
// (ns); 4 its score (µs); 5 the index member; 6 the nonce's expiry (ms).
// The lease's remaining time is counted from the record's last update.
var heartbeatScript = redis.NewScript(`#!lua flags=allow-oom
` + luaBackstop + `
local rec, lease, nonce = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', nonce) == 1 then return 1 end
local f = redis.call('HMGET', rec, 'st', 'o', 'g', 'ua', 'w', 'ca')
if f[1] ~= '1' or f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then return 0 end
redis.call('HSET', rec, 'lu', ARGV[3])
redis.call('ZADD', lease, ARGV[4], ARGV[5])
local left = math.max(math.floor((tonumber(ARGV[3]) - tonumber(f[4] or f[6])) / 1e6), 0)
redis.call('PEXPIRE', rec, left + (tonumber(f[5]) or 0) + backstop)
redis.call('SET', nonce, '1', 'PX', ARGV[6])
return 1
`)

// pointScript sets the recovery point. KEYS: record, the call's nonce.
// ARGV: 1 owner; 2 generation; 3 point; 4 data; 5 "1" when there is data;
// 6 now (ns); 7 the nonce's expiry (ms).
var pointScript = redis.NewScript(`#!lua flags=allow-oom
` + luaBackstop + `
local rec, nonce = KEYS[1], KEYS[2]
if redis.call('EXISTS', nonce) == 1 then return 1 end
local f = redis.call('HMGET', rec, 'st', 'o', 'g', 'lu', 'w')
if f[1] ~= '1' or f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then return 0 end
redis.call('HSET', rec, 'rp', ARGV[3], 'ua', ARGV[6])
if ARGV[5] == '1' then
  redis.call('HSET', rec, 'rd', ARGV[4])
else
  redis.call('HDEL', rec, 'rd')
end
local left = math.max(math.floor((tonumber(f[4]) - tonumber(ARGV[6])) / 1e6), 0)
redis.call('PEXPIRE', rec, left + (tonumber(f[5]) or 0) + backstop)
redis.call('SET', nonce, '1', 'PX', ARGV[7])
return 1
`)

// releaseScript deletes a record in progress. KEYS: record, lease index,
// the call's nonce. ARGV: 1 owner; 2 generation; 3 the index member; 4 the
// nonce's expiry (ms from now).
var releaseScript = redis.NewScript(`#!lua flags=allow-oom
local rec, lease, nonce = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', nonce) == 1 then return 1 end
local f = redis.call('HMGET', rec, 'st', 'o', 'g')
if f[1] ~= '1' or f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then return 0 end
redis.call('DEL', rec)
redis.call('ZREM', lease, ARGV[3])
redis.call('SET', nonce, '1', 'PX', ARGV[4])
return 1
`)

// reapScript deletes a record last updated before the horizon: completed
// before it, or in progress with its lease also ended before it. KEYS: record, lease
// index, done index. ARGV: 1 horizon (ns); 2 the index member. It answers
// 1 when it deleted the record; a member whose record is gone (expired in
// Redis) leaves the indexes, and it answers 0.
var reapScript = redis.NewScript(luaLess + `
local rec, lease, done = KEYS[1], KEYS[2], KEYS[3]
local f = redis.call('HMGET', rec, 'st', 'ua', 'lu', 'co', 'ca')
if not f[1] then
  redis.call('ZREM', lease, ARGV[2])
  redis.call('ZREM', done, ARGV[2])
  return 0
end
if (f[1] == '2' and lt(f[4], ARGV[1])) or
  (f[1] == '1' and lt(f[2] or f[5], ARGV[1]) and lt(f[3], ARGV[1])) then
  redis.call('DEL', rec)
  redis.call('ZREM', lease, ARGV[2])
  redis.call('ZREM', done, ARGV[2])
  return 1
end
return 0
`)

// fetchScript reads a record listed in an index. KEYS: record, lease
// index, done index. ARGV: 1 the index member. It answers the record's
// fields and values, or nil when it is gone (expired in Redis), and then
// removes the member from the indexes.
var fetchScript = redis.NewScript(`#!lua flags=allow-oom
local rec, lease, done = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', rec) == 0 then
  redis.call('ZREM', lease, ARGV[1])
  redis.call('ZREM', done, ARGV[1])
  return false
end
return redis.call('HGETALL', rec)
`)

// getScript reads a record. KEYS: record. A script, not a bare HGETALL,
// so that it runs on the primary even for a client that sends reads to
// replicas (ReadOnly, RouteByLatency): the middleware decides from what it
// reads, and a replica may lag.
var getScript = redis.NewScript(`#!lua flags=no-writes
return redis.call('HGETALL', KEYS[1])
`)

// quarantineScript quarantines a shard whose marker does not vouch for it
// (the Store's check: see guard). KEYS: the marker. ARGV: 1 the Store's
// epoch; 2 now (ns); 3 "1" to quarantine a shard whose marker vouches for
// it too (Redis evicted keys). It answers 0 (the marker vouches for the
// shard: unchanged), 1 (quarantined now) or 2 (quarantined before:
// unchanged). allow-oom: the marker is small, and a full Redis is no reason
// to trust one that forgot.
var quarantineScript = redis.NewScript(`#!lua flags=allow-oom
` + luaTrusted + `
local m = redis.call('GET', KEYS[1])
if m and m:sub(1, 1) == 'q' then return 2 end
if ARGV[3] ~= '1' and trusted(m, ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], 'q' .. ARGV[2])
return 1
`)

// finishArmScript ends the arming of a new prefix (see guard.arm): it
// turns shard 0's marker from "p" and the epoch into "n" and the epoch,
// and changes nothing if it holds anything else. KEYS: the marker. ARGV: 1
// the epoch.
var finishArmScript = redis.NewScript(`#!lua flags=allow-oom
if redis.call('GET', KEYS[1]) == 'p' .. ARGV[1] then
  redis.call('SET', KEYS[1], 'n' .. ARGV[1])
end
return 0
`)

// markerScript reads a marker (the Store's checks). KEYS: the marker. A
// script, as getScript, so that it reads the primary: a replica may lag.
// Sent whole (EVAL), a few bytes, so that a Redis that lost its scripts
// with its records answers it too.
var markerScript = redis.NewScript(`#!lua flags=no-writes
return redis.call('GET', KEYS[1])
`)
