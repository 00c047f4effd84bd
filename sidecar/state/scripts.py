"""The Lua scripts the Redis store runs: each one a single atomic step, so replicas that race on a
session (two closes, a close and an expiry, two sweeps) agree on one outcome.

Keys (``P`` is the configured ``key_prefix``; every key carries a TTL):

- ``P s:<id>``: one session, a hash (field names in :mod:`sidecar.state.records`); holders are
  fields ``h:<replica>`` = that replica's requests in flight.
- ``P live``: sorted set of sessions not yet ended, scored by the time (ms) they end unless
  something happens: the idle deadline, or the end of a close's settle window.
- ``P k:<id>``: the ids of a session's children, ended ones included (for the tree views, which
  read a bounded part of it).
- ``P api``: sorted set of API-created sessions by creation sequence (``P seq``); ``P apin``
  counts the active ones.
- ``P rep:<replica>``: a replica's lease; holder fields of a replica whose lease expired are
  ignored (a killed replica never blocks an end).
- Channel ``P ev``: ``c <id> <reason>`` when a session starts closing, ``e <id>`` when it ended.

Scripts build key names from the prefix (standalone Redis or Valkey; not Redis Cluster).
"""

from __future__ import annotations

# Flags of a session record (field f).
PLACEHOLDER = 1  # named by a child or a root hint only
FINAL_SEEN = 2
CLOSED = 4  # closing (close requested; ends once nothing is in flight anywhere)
ENDED = 8
HINTED = 16  # placed under a root hint; p names the hint, reported parent is none
API = 32  # created through the sessions API

_COMMON = """
local P = ARGV[1]
local function skey(id) return P .. 's:' .. id end
local function holders_live(k)
  local fields = redis.call('HGETALL', k)
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, 2) == 'h:' and tonumber(fields[i + 1]) > 0 then
      if redis.call('EXISTS', P .. 'rep:' .. string.sub(f, 3)) == 1 then return true end
    end
  end
  return false
end
local function drop_holders(k)
  local fields = redis.call('HKEYS', k)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'h:' then redis.call('HDEL', k, fields[i]) end
  end
end
-- End session id now (reason, at ms): the claim every end goes through, exactly once.
local function finish(id, k, f, reason, now, tomb)
  redis.call('HSET', k, 'f', bit.bor(f, 8), 'e', reason, 'z', now)
  drop_holders(k)
  redis.call('EXPIRE', k, tomb)
  redis.call('ZREM', P .. 'live', id)
  if bit.band(f, 32) ~= 0 and bit.band(f, 4) == 0 then redis.call('DECR', P .. 'apin') end
  redis.call('PUBLISH', P .. 'ev', 'e ' .. id)
  local v = redis.call('HMGET', k, 'd', 'p', 'r', 'n', 'ws')
  return {id, v[1] or '', (bit.band(f, 16) == 0 and v[2]) or '', v[3] or id, v[4] or '0', reason,
          tostring(bit.band(f, 32)), v[5] or ''}
end
"""

# ARGV: prefix, now_ms, replica, tombstone ttl s, lease s, kids ttl s, then ops (see
# sidecar.state.redis.Flush). Returns {missing ids, ended ids}.
FLUSH = (
    _COMMON
    + """
local now, rid = tonumber(ARGV[2]), ARGV[3]
local lease, kttl = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('SET', P .. 'rep:' .. rid, '1', 'EX', lease)
for _, shared in ipairs({'live', 'api', 'seq', 'apin'}) do redis.call('EXPIRE', P .. shared, kttl) end
local missing, ended = {}, {}
local i = 7
local live = P .. 'live'
while i <= #ARGV do
  local op, id = ARGV[i], ARGV[i + 1]
  local k = skey(id)
  if op == 'C' or op == 'R' then
    -- create: C (a first request) replaces a placeholder or an ended record; R (republish) only
    -- fills a missing one. ARGV: d p r f c a n deadline ttl ws t q (q '': not an API session)
    local f = tonumber(redis.call('HGET', k, 'f') or '-1')
    local replace = f < 0 or (op == 'C' and (bit.band(f, 8) ~= 0 or bit.band(f, 1) ~= 0))
    if replace then
      if f >= 0 then redis.call('DEL', k) end
      redis.call('HSET', k, 'd', ARGV[i + 2], 'f', ARGV[i + 5], 'c', ARGV[i + 6], 'a', ARGV[i + 7],
                 'n', ARGV[i + 8])
      if ARGV[i + 3] ~= '' then redis.call('HSET', k, 'p', ARGV[i + 3]) end
      if ARGV[i + 4] ~= '' then redis.call('HSET', k, 'r', ARGV[i + 4]) end
      redis.call('EXPIRE', k, ARGV[i + 10])
      redis.call('ZADD', live, ARGV[i + 9], id)
      if ARGV[i + 3] ~= '' then
        local kk = P .. 'k:' .. ARGV[i + 3]
        redis.call('SADD', kk, id)
        redis.call('EXPIRE', kk, kttl)
      end
      if ARGV[i + 13] ~= '' then
        -- an API session whose record the store lost (f has its bit): its fields, its place in
        -- the listing, and in the count unless the listing still holds it (then the count does
        -- too); seq stays past it
        local seq = tonumber(ARGV[i + 13])
        redis.call('HSET', k, 'q', seq)
        if ARGV[i + 11] ~= '' then redis.call('HSET', k, 'ws', ARGV[i + 11]) end
        if ARGV[i + 12] ~= '' then redis.call('HSET', k, 't', ARGV[i + 12]) end
        if redis.call('ZADD', P .. 'api', seq, id) == 1 then redis.call('INCR', P .. 'apin') end
        if tonumber(redis.call('GET', P .. 'seq') or '0') < seq then redis.call('SET', P .. 'seq', seq) end
        for _, shared in ipairs({'api', 'seq', 'apin'}) do redis.call('EXPIRE', P .. shared, kttl) end
      end
    elseif op == 'C' and bit.band(f, 8) == 0 then
      -- created meanwhile by another replica (or through the API): add this replica's turns
      redis.call('HINCRBY', k, 'n', ARGV[i + 8])
      redis.call('HSET', k, 'a', ARGV[i + 7])
      if bit.band(f, 4) == 0 then redis.call('ZADD', live, 'GT', ARGV[i + 9], id) end
    end
    i = i + 14
  elseif op == 'P' then
    -- placeholder: d ttl (only when the id is unknown)
    if redis.call('EXISTS', k) == 0 then
      redis.call('HSET', k, 'd', ARGV[i + 2], 'f', 1, 'c', now, 'a', now)
      redis.call('EXPIRE', k, ARGV[i + 3])
    end
    i = i + 4
  elseif op == 'U' then
    -- turns and activity: dturns active deadline ttl
    local f = tonumber(redis.call('HGET', k, 'f') or '-1')
    if f < 0 then
      missing[#missing + 1] = id
    elseif bit.band(f, 8) ~= 0 then
      ended[#ended + 1] = id
    else
      if ARGV[i + 2] ~= '0' then redis.call('HINCRBY', k, 'n', ARGV[i + 2]) end
      redis.call('HSET', k, 'a', ARGV[i + 3])
      if bit.band(f, 4) == 0 then redis.call('ZADD', live, 'GT', ARGV[i + 4], id) end
      redis.call('EXPIRE', k, ARGV[i + 5])
    end
    i = i + 6
  elseif op == 'H' then
    -- this replica's requests in flight: count
    if redis.call('EXISTS', k) == 1 then
      if ARGV[i + 2] == '0' then redis.call('HDEL', k, 'h:' .. rid)
      else redis.call('HSET', k, 'h:' .. rid, ARGV[i + 2]) end
    end
    i = i + 3
  elseif op == 'F' then
    -- flags to add: bits
    local f = tonumber(redis.call('HGET', k, 'f') or '-1')
    if f >= 0 then redis.call('HSET', k, 'f', bit.bor(f, tonumber(ARGV[i + 2]))) end
    i = i + 3
  elseif op == 'M' then
    -- the mode's state: value
    if redis.call('EXISTS', k) == 1 then redis.call('HSET', k, 'm', ARGV[i + 2]) end
    i = i + 3
  elseif op == 'W' then
    -- worker history: runs (JSON) worker_turns moves
    if redis.call('EXISTS', k) == 1 then
      redis.call('HSET', k, 'w', ARGV[i + 2], 'wt', ARGV[i + 3], 'mv', ARGV[i + 4])
    end
    i = i + 5
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
return {missing, ended}
"""
)

# ARGV: prefix, id, now_ms, reason, settle_ms. Starts closing a session (its requests in flight
# anywhere finish; then one replica ends it). Returns 1 closing now, 2 already closing,
# 0 unknown, -1 already ended.
CLOSE = (
    _COMMON
    + """
local id, now, reason, settle = ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local k = skey(id)
local f = tonumber(redis.call('HGET', k, 'f') or '-1')
if f < 0 or bit.band(f, 1) ~= 0 then return 0 end
if bit.band(f, 8) ~= 0 then return -1 end
if bit.band(f, 4) ~= 0 then return 2 end
redis.call('HSET', k, 'f', bit.bor(f, 4), 'e', reason, 'z', now)
redis.call('ZADD', P .. 'live', now + settle, id)
if bit.band(f, 32) ~= 0 then redis.call('DECR', P .. 'apin') end
redis.call('PUBLISH', P .. 'ev', 'c ' .. id .. ' ' .. reason)
return 1
"""
)

# ARGV: prefix, id, now_ms, tombstone ttl s, settle_ms. Ends a closing session once its settle
# window passed and no live replica has a request of it in flight. Returns the ended session
# ({id, d, p, r, n, reason, api, workspace}) to the one caller that ended it, else {'', wait_ms}
# (wait_ms: when to check again; -1: nothing left to do).
END_CHECK = (
    _COMMON
    + """
local id, now, tomb, settle = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local k = skey(id)
local v = redis.call('HMGET', k, 'f', 'z', 'e')
local f = tonumber(v[1] or '-1')
if f < 0 or bit.band(f, 8) ~= 0 or bit.band(f, 4) == 0 then return {'', -1} end
local due = tonumber(v[2] or '0') + settle
if now < due then return {'', due - now} end
if holders_live(k) then return {'', -1} end
return finish(id, k, f, v[3] or 'api_closed', now, tomb)
"""
)

# ARGV: prefix, now_ms, limit, cap, tombstone ttl s, settle_ms, idle ttl ms. Claims, at most
# limit of each: sessions due (idle past their deadline, or closing past the settle window) and,
# while more than cap sessions live, the ones due soonest (evicted). A session with requests in
# flight on a live replica is never claimed (its deadline moves on). Returns the claimed ones.
SWEEP = (
    _COMMON
    + """
local now, limit, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tomb, settle, idle = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local live = P .. 'live'
local out = {}
local function claim(id, evicting)
  local k = skey(id)
  local v = redis.call('HMGET', k, 'f', 'z', 'e', 't')
  local f = tonumber(v[1] or '-1')
  if f < 0 or bit.band(f, 8) ~= 0 then redis.call('ZREM', live, id); return end
  if holders_live(k) then
    redis.call('ZADD', live, now + (bit.band(f, 4) ~= 0 and settle or idle), id)
    return
  end
  local reason
  if bit.band(f, 4) ~= 0 then
    if tonumber(v[2] or '0') + settle > now and not evicting then return end
    reason = v[3] or 'api_closed'
  else
    reason = evicting and 'evicted' or 'idle_expired'
  end
  out[#out + 1] = finish(id, k, f, reason, now, tomb)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, limit)) do claim(id, false) end
local over = redis.call('ZCARD', live) - cap
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', live, 0, math.min(over, limit) - 1)) do claim(id, true) end
end
return out
"""
)

# ARGV: prefix, id, deployment, workspace, parent, ttl_s ('' = none), now_ms, deadline_ms
# ('+inf' without ttl), key ttl s, max active. Creates an API session. Returns its sequence
# number, 0 when the id is taken (a session, live or remembered, or a live traffic session),
# -2 when max active API sessions exist already.
API_CREATE = (
    _COMMON
    + """
local id, now = ARGV[2], ARGV[7]
local k = skey(id)
local f = tonumber(redis.call('HGET', k, 'f') or '-1')
if f >= 0 and bit.band(f, 1) == 0 and (bit.band(f, 8) == 0 or bit.band(f, 32) ~= 0) then return 0 end
if tonumber(redis.call('GET', P .. 'apin') or '0') >= tonumber(ARGV[10]) then return -2 end
local seq = redis.call('INCR', P .. 'seq')
if f >= 0 then redis.call('DEL', k) end
redis.call('HSET', k, 'd', ARGV[3], 'f', 32, 'c', now, 'a', now, 'n', 0, 'q', seq)
if ARGV[4] ~= '' then redis.call('HSET', k, 'ws', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSET', k, 'p', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', k, 't', ARGV[6]) end
redis.call('EXPIRE', k, ARGV[9])
redis.call('ZADD', P .. 'live', ARGV[8], id)
redis.call('ZADD', P .. 'api', seq, id)
redis.call('INCR', P .. 'apin')
if ARGV[5] ~= '' then
  redis.call('SADD', P .. 'k:' .. ARGV[5], id)
  redis.call('EXPIRE', P .. 'k:' .. ARGV[5], ARGV[9])
end
return seq
"""
)
