"""The Lua scripts the Redis store runs: each one a single atomic step, so replicas that race on a
session (two closes, a close and an expiry, two sweeps) agree on one outcome.

Keys (``P`` is the configured ``key_prefix``; every key carries a TTL, and an index's TTL is only
ever raised to cover what it indexes):

- ``P s:<id>``: one session, a hash (field names in :mod:`sidecar.state.records`); holders are
  fields ``h:<replica>`` = that replica's requests in flight; ``o`` names the replica that
  claimed its end until that replica confirms it ran it.
- ``P live``: sorted set of sessions not yet ended, scored by the time (ms) they end unless
  something happens: the idle deadline, or the end of a close's settle window.
- ``P ends``: sorted set of claimed ends not yet confirmed, scored by when they were last handed
  out: handed again to their claimer (whose reply may have been lost), or to another replica
  once the claimer's lease expired.
- ``P k:<id>``: the ids of a session's children, ended ones included (for the tree views, which
  read a bounded part of it).
- ``P api``: sorted set of API-created sessions by creation sequence (``P seq``); ``P apin``
  counts the active ones.
- ``P rep:<replica>``: a replica's lease; holder fields of a replica whose lease expired are
  ignored (a killed replica never blocks an end), and its unconfirmed claims go to another.
- ``P ep``: the store's epoch, when ends may run; found missing while replicas run, it means the
  store lost its data: ends wait ``QUIET_MS`` while every replica republishes what it holds.
- Channel ``P ev``: ``c <id> <reason>`` when a session starts closing, ``e <id> <reason>`` when
  it ended (a reason is one word; the id is everything before the last space).

A record a script cannot read (its flags are not a number: written by something else, or by a
newer version) is never modified or ended; scripts report it instead.

Scripts build key names from the prefix (standalone Redis or Valkey; not Redis Cluster).
"""

from __future__ import annotations

from sidecar.context import SessionFlag

# A record's flags (field f) are sidecar.lineage.SessionFlag's: the scripts name them as Lua
# locals of the same values. CLOSED on a record means closing: close requested, it ends once
# nothing is in flight anywhere; HINTED: placed under a root hint (p names the hint, the
# reported parent is none).
_FLAGS = ("PLACEHOLDER", "FINAL_SEEN", "CLOSED", "ENDED", "HINTED", "API")

# How long after the store lost its data (the epoch key ``P ep`` was found missing by a running
# fleet) no session ends: every live replica has renewed its lease and republished what it holds
# (its requests in flight included) by then, so an end never misses a holder the store forgot.
QUIET_MS = 10_000

_COMMON = (
    f"""
local P = ARGV[1]
local QUIET = {QUIET_MS}
local {", ".join(_FLAGS)} = {", ".join(str(int(SessionFlag[name])) for name in _FLAGS)}
"""
    + """
local function skey(id) return P .. 's:' .. id end
local function num(v, default) return tonumber(v) or default end
-- A record's flags: -1 no record, -2 a record this version cannot read (never touched).
local function flags_of(k)
  local v = redis.call('HGET', k, 'f')
  if not v then return -1 end
  local f = tonumber(v)
  if f == nil or f < 0 or f ~= math.floor(f) then return -2 end
  return f
end
-- An index lives at least as long as what it indexes: its TTL is only ever raised.
local function extend(k, ttl)
  local t = redis.call('TTL', k)
  if t ~= -2 and t < tonumber(ttl) then redis.call('EXPIRE', k, ttl) end
end
-- The store's epoch: when ends may run (ms). Missing: the store is new or lost its data; ends
-- then wait ``quiet`` ms for the replicas to republish what they hold.
local function epoch(now, quiet)
  local ep = redis.call('GET', P .. 'ep')
  if not ep then
    ep = tostring(now + quiet)
    redis.call('SET', P .. 'ep', ep, 'EX', 86400)
  end
  return ep
end
local function holders_live(k)
  local fields = redis.call('HGETALL', k)
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, 2) == 'h:' and num(fields[i + 1], 0) > 0 then
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
-- What the claimer of an end needs: {id, d, p, r, n, reason, api, workspace, token}; the token
-- (when the session ended, ms) tells this end from a later one of a reused id.
local function row(id, k, f, reason)
  local v = redis.call('HMGET', k, 'd', 'p', 'r', 'n', 'ws', 'z')
  return {id, v[1] or '', (bit.band(f, HINTED) == 0 and v[2]) or '', v[3] or id, v[4] or '0', reason,
          tostring(bit.band(f, API)), v[5] or '', v[6] or ''}
end
-- End session id now, claimed by replica rid: the claim every end goes through, exactly once.
-- The claim stays in ``ends`` until its claimer confirms it ran the end (op K of FLUSH).
local function finish(id, k, f, reason, now, tomb, rid)
  redis.call('HSET', k, 'f', bit.bor(f, ENDED), 'e', reason, 'o', rid)
  redis.call('HSETNX', k, 'z', now)
  drop_holders(k)
  redis.call('EXPIRE', k, tomb)
  redis.call('ZREM', P .. 'live', id)
  redis.call('ZADD', P .. 'ends', now, id)
  extend(P .. 'ends', tomb)
  if bit.band(f, API) ~= 0 and bit.band(f, CLOSED) == 0 then redis.call('DECR', P .. 'apin') end
  redis.call('PUBLISH', P .. 'ev', 'e ' .. id .. ' ' .. reason)
  return row(id, k, f, reason)
end
"""
)

# ARGV: prefix, now_ms, quiet_ms. Proves the store usable (a script runs) and returns its epoch,
# creating it when missing (quiet_ms 0 at a replica's start: nothing can be held yet).
HELLO = (
    _COMMON
    + """
return epoch(tonumber(ARGV[2]), tonumber(ARGV[3]))
"""
)

# ARGV: prefix, now_ms, replica, tombstone ttl s, lease s, shared keys' ttl s, then ops (see
# sidecar.state.redis). Returns {missing ids, ended {id, reason}..., closing {id, reason}...,
# unreadable ids, epoch}.
FLUSH = (
    _COMMON
    + """
local now, rid = tonumber(ARGV[2]), ARGV[3]
local lease, kttl = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('SET', P .. 'rep:' .. rid, '1', 'EX', lease)
local ep = epoch(now, QUIET)
for _, shared in ipairs({'live', 'api', 'seq', 'apin', 'ends', 'ep'}) do extend(P .. shared, kttl) end
local missing, ended, closing, bad = {}, {}, {}, {}
local i = 7
local live = P .. 'live'
local function closing_now(id, k, f)
  if bit.band(f, CLOSED) ~= 0 and bit.band(f, ENDED) == 0 then
    closing[#closing + 1] = id
    closing[#closing + 1] = redis.call('HGET', k, 'e') or 'api_closed'
  end
end
while i <= #ARGV do
  local op, id = ARGV[i], ARGV[i + 1]
  local k = skey(id)
  if op == 'C' or op == 'R' then
    -- create: C (a first request) replaces a placeholder or an ended record; R (republish) only
    -- fills a missing one, or raises the turn count of a live one to what this replica counted.
    -- ARGV: d p r f c a n deadline ttl ws t q (q '': not an API session)
    local f = flags_of(k)
    -- an API session's id is not taken over while its tombstone lasts (410 everywhere)
    local tomb = f >= 0 and bit.band(f, ENDED) ~= 0 and bit.band(f, API) ~= 0
    local replace = f == -1 or (op == 'C' and f >= 0 and not tomb and (bit.band(f, ENDED) ~= 0 or bit.band(f, PLACEHOLDER) ~= 0))
    local ttl = ARGV[i + 10]
    if f == -2 then
      bad[#bad + 1] = id
    elseif tomb and op == 'C' then
      -- admitted by a replica that had not heard of the end yet: it is told now
      ended[#ended + 1] = id
      ended[#ended + 1] = redis.call('HGET', k, 'e') or ''
    elseif replace then
      if f >= 0 then redis.call('DEL', k) end
      redis.call('HSET', k, 'd', ARGV[i + 2], 'f', ARGV[i + 5], 'c', ARGV[i + 6], 'a', ARGV[i + 7],
                 'n', ARGV[i + 8])
      if ARGV[i + 3] ~= '' then redis.call('HSET', k, 'p', ARGV[i + 3]) end
      if ARGV[i + 4] ~= '' then redis.call('HSET', k, 'r', ARGV[i + 4]) end
      redis.call('EXPIRE', k, ttl)
      redis.call('ZADD', live, ARGV[i + 9], id)
      extend(live, ttl)
      if ARGV[i + 3] ~= '' then
        local kk = P .. 'k:' .. ARGV[i + 3]
        redis.call('SADD', kk, id)
        extend(kk, ttl)
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
        if num(redis.call('GET', P .. 'seq'), 0) < seq then redis.call('SET', P .. 'seq', seq) end
        for _, shared in ipairs({'api', 'seq', 'apin'}) do extend(P .. shared, ttl) end
      end
    elseif bit.band(f, ENDED) == 0 then
      if op == 'C' then
        -- created meanwhile by another replica (or through the API): add this replica's turns
        redis.call('HINCRBY', k, 'n', ARGV[i + 8])
        redis.call('HSET', k, 'a', ARGV[i + 7])
        if bit.band(f, CLOSED) == 0 then redis.call('ZADD', live, 'GT', ARGV[i + 9], id) end
      elseif num(redis.call('HGET', k, 'n'), 0) < tonumber(ARGV[i + 8]) then
        redis.call('HSET', k, 'n', ARGV[i + 8])
      end
      closing_now(id, k, f)
    end
    i = i + 14
  elseif op == 'P' then
    -- placeholder: d ttl (only when the id is unknown)
    if redis.call('EXISTS', k) == 0 then
      redis.call('HSET', k, 'd', ARGV[i + 2], 'f', PLACEHOLDER, 'c', now, 'a', now)
      redis.call('EXPIRE', k, ARGV[i + 3])
    end
    i = i + 4
  elseif op == 'U' then
    -- turns and activity: dturns active deadline ttl
    local f = flags_of(k)
    if f == -1 then
      missing[#missing + 1] = id
    elseif f == -2 then
      bad[#bad + 1] = id
    elseif bit.band(f, ENDED) ~= 0 then
      ended[#ended + 1] = id
      ended[#ended + 1] = redis.call('HGET', k, 'e') or ''
    else
      if ARGV[i + 2] ~= '0' then
        local r = redis.pcall('HINCRBY', k, 'n', ARGV[i + 2])
        if type(r) == 'table' and r.err then bad[#bad + 1] = id end
      end
      redis.call('HSET', k, 'a', ARGV[i + 3])
      if bit.band(f, CLOSED) == 0 then redis.call('ZADD', live, 'GT', ARGV[i + 4], id) end
      redis.call('EXPIRE', k, ARGV[i + 5])
      extend(live, ARGV[i + 5])
      closing_now(id, k, f)
    end
    i = i + 6
  elseif op == 'H' then
    -- this replica's requests in flight: count
    local f = flags_of(k)
    if f >= 0 then
      if ARGV[i + 2] == '0' then redis.call('HDEL', k, 'h:' .. rid)
      else redis.call('HSET', k, 'h:' .. rid, ARGV[i + 2]) end
      closing_now(id, k, f)
    end
    i = i + 3
  elseif op == 'F' then
    -- flags to add: bits
    local f = flags_of(k)
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
  elseif op == 'A' or op == 'B' then
    -- prompt-cache accounting: prompt cached turns-with-usage unknown-turns. A adds them (this
    -- replica's increments, ended records included: a final turn's arrive after its end); B
    -- (republish) raises each to at least them. A field is written only once non-zero.
    local f = flags_of(k)
    if f == -2 then
      bad[#bad + 1] = id
    elseif f >= 0 then
      for j, field in ipairs({'pt', 'ct', 'ut', 'uu'}) do
        local n = tonumber(ARGV[i + 1 + j]) or 0
        if n > 0 then
          if op == 'A' then
            local r = redis.pcall('HINCRBY', k, field, n)
            if type(r) == 'table' and r.err then bad[#bad + 1] = id end
          elseif num(redis.call('HGET', k, field), 0) < n then
            redis.call('HSET', k, field, n)
          end
        end
      end
    end
    i = i + 6
  elseif op == 'K' then
    -- this replica ran the end it claimed (token: the claim's): the claim is settled
    local v = redis.call('HMGET', k, 'o', 'z')
    if v[1] == rid and v[2] == ARGV[i + 2] then
      redis.call('ZREM', P .. 'ends', id)
      redis.call('HDEL', k, 'o')
    end
    i = i + 3
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
return {missing, ended, closing, bad, ep}
"""
)

# ARGV: prefix, id, now_ms, reason, settle_ms. Starts closing a session (its requests in flight
# anywhere finish; then one replica ends it). Returns 1 closing now, 2 already closing,
# 0 unknown (or unreadable), -1 already ended.
CLOSE = (
    _COMMON
    + """
local id, now, reason, settle = ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local k = skey(id)
local f = flags_of(k)
if f < 0 or bit.band(f, PLACEHOLDER) ~= 0 then return 0 end
if bit.band(f, ENDED) ~= 0 then return -1 end
if bit.band(f, CLOSED) ~= 0 then return 2 end
redis.call('HSET', k, 'f', bit.bor(f, CLOSED), 'e', reason, 'z', now)
redis.call('ZADD', P .. 'live', now + settle, id)
if bit.band(f, API) ~= 0 then redis.call('DECR', P .. 'apin') end
redis.call('PUBLISH', P .. 'ev', 'c ' .. id .. ' ' .. reason)
return 1
"""
)

# ARGV: prefix, id, now_ms, tombstone ttl s, settle_ms, replica. Ends a closing session once its
# settle window (and any quiet period) passed and no live replica has a request of it in
# flight. Returns the ended session (a row, see finish) to the one caller that ended it, and to
# that caller again while it has not confirmed the end (its reply may have been lost); else
# {'', wait_ms} (wait_ms: when to check again; -1: nothing left to do).
END_CHECK = (
    _COMMON
    + """
local id, now, tomb, settle, rid = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local k = skey(id)
local f = flags_of(k)
if f < 0 then return {'', -1} end
if bit.band(f, ENDED) ~= 0 then
  if redis.call('HGET', k, 'o') == rid and redis.call('ZSCORE', P .. 'ends', id) then
    return row(id, k, f, redis.call('HGET', k, 'e') or 'api_closed')
  end
  return {'', -1}
end
if bit.band(f, CLOSED) == 0 then return {'', -1} end
local due = math.max(num(redis.call('HGET', k, 'z'), 0) + settle, tonumber(epoch(now, QUIET)))
if now < due then return {'', due - now} end
if holders_live(k) then return {'', -1} end
return finish(id, k, f, redis.call('HGET', k, 'e') or 'api_closed', now, tomb, rid)
"""
)

# ARGV: prefix, now_ms, limit, cap, tombstone ttl s, settle_ms, idle ttl ms, replica, late_ms.
# Hands out, at most limit of each: claims not confirmed for late_ms, to their claimer again (its
# reply may have been lost) or to this replica when the claimer's lease expired (it died before
# running the end); sessions due (idle past their deadline, or closing past the settle window);
# and, while more than cap sessions live, the ones due soonest (evicted). A session with requests
# in flight on a live replica is never claimed (its deadline moves on). Returns {rows, unreadable
# ids} (rows as finish returns them).
SWEEP = (
    _COMMON
    + """
local now, limit, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tomb, settle, idle = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local rid, late = ARGV[8], tonumber(ARGV[9])
local out, bad = {}, {}
if now < tonumber(epoch(now, QUIET)) then return {out, bad} end
local live, ends = P .. 'live', P .. 'ends'
for _, id in ipairs(redis.call('ZRANGEBYSCORE', ends, '-inf', now - late, 'LIMIT', 0, limit)) do
  local k = skey(id)
  local f = flags_of(k)
  if f < 0 or bit.band(f, ENDED) == 0 then
    redis.call('ZREM', ends, id)
  else
    -- (a claim of another live replica keeps its score: its claimer finds it by that)
    local owner = redis.call('HGET', k, 'o')
    if owner == rid or not owner or redis.call('EXISTS', P .. 'rep:' .. owner) == 0 then
      redis.call('HSET', k, 'o', rid)
      redis.call('ZADD', ends, now, id)
      out[#out + 1] = row(id, k, f, redis.call('HGET', k, 'e') or 'api_closed')
    end
  end
end
local function claim(id, evicting)
  local k = skey(id)
  local f = flags_of(k)
  if f == -2 then bad[#bad + 1] = id end
  if f < 0 or bit.band(f, ENDED) ~= 0 then redis.call('ZREM', live, id); return end
  if holders_live(k) then
    redis.call('ZADD', live, now + (bit.band(f, CLOSED) ~= 0 and settle or idle), id)
    return
  end
  local reason
  if bit.band(f, CLOSED) ~= 0 then
    if num(redis.call('HGET', k, 'z'), 0) + settle > now and not evicting then return end
    reason = redis.call('HGET', k, 'e') or 'api_closed'
  else
    reason = evicting and 'evicted' or 'idle_expired'
  end
  out[#out + 1] = finish(id, k, f, reason, now, tomb, rid)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, limit)) do claim(id, false) end
local over = redis.call('ZCARD', live) - cap
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', live, 0, math.min(over, limit) - 1)) do claim(id, true) end
end
return {out, bad}
"""
)

# ARGV: prefix, id, deployment, workspace, parent, ttl_s ('' = none), now_ms, deadline_ms
# ('+inf' without ttl), key ttl s, max active, root (the parent's root; '' without a parent).
# Creates an API session. Returns its sequence
# number, 0 when the id is taken (a session, live or remembered, a live traffic session, or a
# record this version cannot read), -2 when max active API sessions exist already.
API_CREATE = (
    _COMMON
    + """
local id, now, ttl = ARGV[2], ARGV[7], ARGV[9]
local k = skey(id)
local f = flags_of(k)
if f == -2 or (f >= 0 and bit.band(f, PLACEHOLDER) == 0 and (bit.band(f, ENDED) == 0 or bit.band(f, API) ~= 0)) then return 0 end
if num(redis.call('GET', P .. 'apin'), 0) >= tonumber(ARGV[10]) then return -2 end
local seq = redis.call('INCR', P .. 'seq')
if f >= 0 then redis.call('DEL', k) end
redis.call('HSET', k, 'd', ARGV[3], 'f', API, 'c', now, 'a', now, 'n', 0, 'q', seq)
if ARGV[4] ~= '' then redis.call('HSET', k, 'ws', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSET', k, 'p', ARGV[5]) end
if ARGV[11] ~= '' and ARGV[11] ~= id then redis.call('HSET', k, 'r', ARGV[11]) end
if ARGV[6] ~= '' then redis.call('HSET', k, 't', ARGV[6]) end
redis.call('EXPIRE', k, ttl)
redis.call('ZADD', P .. 'live', ARGV[8], id)
redis.call('ZADD', P .. 'api', seq, id)
redis.call('INCR', P .. 'apin')
for _, shared in ipairs({'live', 'api', 'seq', 'apin'}) do extend(P .. shared, ttl) end
if ARGV[5] ~= '' then
  redis.call('SADD', P .. 'k:' .. ARGV[5], id)
  extend(P .. 'k:' .. ARGV[5], ttl)
end
return seq
"""
)
