"""The Lua scripts of the Redis replay queue: each state change of redis.py, as one atomic step.

Concept: Redis runs a script alone, start to finish, and its AOF logs the script's writes as one
MULTI/EXEC block, so a script is what a SQLite transaction is to sqlite.py: a crash (of Redis or of
a client) leaves every script either whole or absent. A script that raises does not roll back
what it already wrote, so the scripts that can refuse (`FINISH`) check every lease before their
first write.

Keys, all under one prefix P (its braces are a Redis Cluster hash tag, so every key of a queue
lives in one slot):
  P:meta          hash   group_size, stale_dropped
  P:g:GID         hash   n, minv (oldest weight version), maxv (newest sampled version: the
                         group is stale once even it is too old; a group stored before it has
                         none and is judged by minv), state, done (completion time),
                         lease, exp (lease expiry; both only while leased)
  P:ge:GID        list   the group's episode ids, in arrival order
  P:e:EID         hash   g (group id), seq, meta, arrays, sum (sha256); the three payload
                         fields are deleted once the group is acked or stale (never read again)
  P:pending       zset   pending groups by completion time (ties by group id, as sqlite.py)
  P:pendv         zset   the same groups by their newest sampled version (the staleness filter)
  P:leased        zset   leased groups by lease expiry
  P:count         hash   "g:STATE" groups and "e:STATE" episodes per state
  P:quarantine    hash   episode id -> JSON {group_id, reason, at}

Clock: leases and completion times use the Redis server's clock (TIME), one clock for every
trainer and rollout host however skewed theirs are.
"""

from __future__ import annotations

__all__ = ["INIT", "PUT", "TAKE", "QUARANTINE", "FINISH", "RENEW", "RECOVER"]

_PRELUDE = """
local P = ARGV[1]
local CNT = P .. ':count'
local function gkey(gid) return P .. ':g:' .. gid end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end
local function count(state, groups, episodes)
  redis.call('HINCRBY', CNT, 'g:' .. state, groups)
  redis.call('HINCRBY', CNT, 'e:' .. state, episodes)
end
-- Move a group between states, keeping the counters, the zsets and the payloads in step.
local function set_state(gid, from, to)
  local g = gkey(gid)
  local f = redis.call('HMGET', g, 'n', 'done', 'minv', 'maxv')
  local n = tonumber(f[1])
  count(from, -1, -n)
  count(to, 1, n)
  redis.call('HSET', g, 'state', to)
  if from == 'leased' then
    redis.call('ZREM', P .. ':leased', gid)
    redis.call('HDEL', g, 'lease', 'exp')
  elseif from == 'pending' then
    redis.call('ZREM', P .. ':pending', gid)
    redis.call('ZREM', P .. ':pendv', gid)
  end
  if to == 'pending' then
    redis.call('ZADD', P .. ':pending', f[2], gid)
    redis.call('ZADD', P .. ':pendv', f[4] or f[3], gid)
  elseif to == 'acked' or to == 'stale' then
    for _, eid in ipairs(redis.call('LRANGE', P .. ':ge:' .. gid, 0, -1)) do
      redis.call('HDEL', P .. ':e:' .. eid, 'meta', 'arrays', 'sum')
    end
  end
  return n
end
"""

# ARGV: P, group_size ('' to open an existing queue). Returns the stored group size, or -1.
INIT = (
    _PRELUDE
    + """
local gs = redis.call('HGET', P .. ':meta', 'group_size')
if gs then return tonumber(gs) end
if ARGV[2] == '' then return -1 end
redis.call('HSET', P .. ':meta', 'group_size', ARGV[2], 'stale_dropped', 0)
return tonumber(ARGV[2])
"""
)

# ARGV: P, eid, gid, min version, group_size, meta, arrays, sum, the episode's sampled version
# ('' when it sampled nothing), UNSAMPLED_VERSION. maxv follows queue/contract.py newest_version
# (a group stored before maxv existed starts from its minv).
# Returns 1 (stored), 0 (id already stored), -1 (the group is already complete).
PUT = (
    _PRELUDE
    + """
local eid, gid = ARGV[2], ARGV[3]
local ekey = P .. ':e:' .. eid
if redis.call('EXISTS', ekey) == 1 then return 0 end
local g = gkey(gid)
local f = redis.call('HMGET', g, 'n', 'minv', 'state', 'maxv')
local n, minv, unsampled = 0, tonumber(ARGV[4]), tonumber(ARGV[10])
local maxv = nil
if f[3] then
  if f[3] ~= 'open' then return -1 end
  n, minv = tonumber(f[1]), math.min(minv, tonumber(f[2]))
  maxv = tonumber(f[4] or f[2])
else
  count('open', 1, 0)
end
if ARGV[9] ~= '' then
  local v = tonumber(ARGV[9])
  if maxv == nil or maxv == unsampled then maxv = v else maxv = math.max(maxv, v) end
elseif maxv == nil then
  maxv = unsampled
end
n = n + 1
redis.call('HSET', ekey, 'g', gid, 'seq', n, 'meta', ARGV[6], 'arrays', ARGV[7], 'sum', ARGV[8])
redis.call('RPUSH', P .. ':ge:' .. gid, eid)
count('open', 0, 1)
redis.call('HSET', g, 'n', n, 'minv', minv, 'maxv', maxv, 'state', 'open')
if n == tonumber(ARGV[5]) then
  redis.call('HSET', g, 'done', fmt(now()))
  set_state(gid, 'open', 'pending')
end
return 1
"""
)

# ARGV: P, n_groups, oldest allowed version ('' for no filter), lease_s, one lease id per group.
# Expires lapsed leases, drops stale groups, then leases up to n_groups pending ones, oldest first.
# Returns one {gid, lease id, expiry, {{eid, meta, arrays, sum}, ...}} per leased group.
TAKE = (
    _PRELUDE
    + """
local t = now()
for _, gid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':leased', '-inf', '(' .. fmt(t))) do
  set_state(gid, 'leased', 'pending')
end
if ARGV[3] ~= '' then
  local dropped = 0
  for _, gid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':pendv', '-inf', '(' .. ARGV[3])) do
    dropped = dropped + set_state(gid, 'pending', 'stale')
  end
  if dropped > 0 then redis.call('HINCRBY', P .. ':meta', 'stale_dropped', dropped) end
end
local out, n = {}, tonumber(ARGV[2])
local exp = fmt(t + tonumber(ARGV[4]))
local picked = {}
if n > 0 then picked = redis.call('ZRANGE', P .. ':pending', 0, n - 1) end
for i, gid in ipairs(picked) do
  local lid = ARGV[4 + i]
  set_state(gid, 'pending', 'leased')
  redis.call('HSET', gkey(gid), 'lease', lid, 'exp', exp)
  redis.call('ZADD', P .. ':leased', exp, gid)
  local eps = {}
  for _, eid in ipairs(redis.call('LRANGE', P .. ':ge:' .. gid, 0, -1)) do
    local e = redis.call('HMGET', P .. ':e:' .. eid, 'meta', 'arrays', 'sum')
    eps[#eps + 1] = {eid, e[1], e[2], e[3]}
  end
  out[#out + 1] = {gid, lid, exp, eps}
end
return out
"""
)

# ARGV: P, gid, lease id, then (episode id, JSON record) pairs. Quarantines a group that `take`
# leased but whose bytes failed their checksum. Returns 1, or 0 if that lease is no longer held.
QUARANTINE = (
    _PRELUDE
    + """
local gid = ARGV[2]
local f = redis.call('HMGET', gkey(gid), 'state', 'lease')
if f[1] ~= 'leased' or f[2] ~= ARGV[3] then return 0 end
set_state(gid, 'leased', 'quarantined')
for i = 4, #ARGV, 2 do redis.call('HSETNX', P .. ':quarantine', ARGV[i], ARGV[i + 1]) end
return 1
"""
)

# ARGV: P, target state (acked | pending), then (gid, lease id) pairs: ack or release. Every
# lease is checked before the first write. Returns {'ok'} or {'unknown'|'lost', gid, lid, state}.
FINISH = (
    _PRELUDE
    + """
local target = ARGV[2]
local todo, seen = {}, {}
for i = 3, #ARGV, 2 do
  local gid, lid = ARGV[i], ARGV[i + 1]
  local f = redis.call('HMGET', gkey(gid), 'state', 'lease')
  local state = f[1]
  if not state then return {'unknown', gid, lid, ''} end
  local noop = (state == 'acked' and target == 'acked') or (state == 'pending' and target == 'pending')
  if not noop and not seen[gid] then
    local unclaimed = (state == 'pending' or state == 'stale') and target == 'acked'
    if f[2] ~= lid and not unclaimed then return {'lost', gid, lid, state} end
    seen[gid] = true
    todo[#todo + 1] = {gid, state}
  end
end
for _, x in ipairs(todo) do set_state(x[1], x[2], target) end
return {'ok'}
"""
)

# ARGV: P, lease_s, then (gid, lease id) pairs: extend the leases still held.
RENEW = (
    _PRELUDE
    + """
local exp = fmt(now() + tonumber(ARGV[2]))
for i = 3, #ARGV, 2 do
  local gid = ARGV[i]
  local f = redis.call('HMGET', gkey(gid), 'state', 'lease')
  if f[1] == 'leased' and f[2] == ARGV[i + 1] then
    redis.call('HSET', gkey(gid), 'exp', exp)
    redis.call('ZADD', P .. ':leased', exp, gid)
  end
end
return 0
"""
)

# ARGV: P, trained episode ids. Acks every not-yet-acked group holding one, then releases every
# other lease. Returns {acked groups, released groups}.
RECOVER = (
    _PRELUDE
    + """
local acked, released, seen = 0, 0, {}
for i = 2, #ARGV do
  local gid = redis.call('HGET', P .. ':e:' .. ARGV[i], 'g')
  if gid and not seen[gid] then
    seen[gid] = true
    local state = redis.call('HGET', gkey(gid), 'state')
    if state == 'leased' or state == 'pending' or state == 'stale' then
      set_state(gid, state, 'acked')
      acked = acked + 1
    end
  end
end
for _, gid in ipairs(redis.call('ZRANGE', P .. ':leased', 0, -1)) do
  set_state(gid, 'leased', 'pending')
  released = released + 1
end
return {acked, released}
"""
)
