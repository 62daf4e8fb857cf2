"""Lua scripts: every state change of a lease is one atomic script, one round trip.

Each script states its KEYS, ARGV and return value in a header. Keys of one
entity share a hash tag, so every script touches a single slot, except
ACQUIRE/RELEASE with a completion key whose scope differs from the entity (one
Redis: fine; Cluster: see docs/operations.md).

Time comes from the server's ``TIME`` (scripts replicate by effects since
Redis 5), so worker clocks never meet in Redis.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from . import _wire
from .exceptions import CorruptFence

_NOW = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
"""

#: Prefix of the error reply a script returns, before writing anything, for a corrupt fence counter.
CORRUPT_FENCE = "LOCKGUARD_CORRUPT_FENCE"

#: Lua numbers are doubles: integers are exact only up to 2**53 - 1, so that is the last fence issued.
MAX_FENCE = 2**53 - 1

_NEXT_FENCE = (
    """
local MAX_FENCE = """
    + str(MAX_FENCE)
    + """
-- nil, last (0 when absent) when the counter is absent or an integer a next fence can exactly follow;
-- else the error reply text. Pass last on to next_fence: the counter is then read once per script.
local function corrupt_fence(fence_key)
  local v = redis.pcall('GET', fence_key)
  if not v then return nil, 0 end
  if type(v) == 'table' then
    v = '<' .. tostring(v.err or v.ok or 'not a string') .. '>'  -- WRONGTYPE: not a string key
  elseif string.match(v, '^%d+$') and #v <= 16 and tonumber(v) < MAX_FENCE then
    return nil, tonumber(v)
  end
  return '"""
    + CORRUPT_FENCE
    + """ ' .. fence_key .. ' ' .. (string.gsub(string.sub(v, 1, 64), '%c', '?'))
end
-- call corrupt_fence first: the counter is then absent or an integer below MAX_FENCE; last: what it read
-- (nil: read it again here)
local function next_fence(fence_key, fence_ttl, now_us, last)
  last = last or tonumber(redis.call('GET', fence_key) or '0')
  local f = string.format('%.0f', math.max(last + 1, now_us))
  redis.call('SET', fence_key, f, 'PX', fence_ttl)
  return f
end
"""
)

_HELD_SLOTS = """
-- The slot leases i >= 1 a lock_limit task holds on K ({K}:lock:<i>; slot 0 is {K}:lock itself), the shared
-- holders the single lease excludes. {K}:fence:<i> marks that slot i was taken within the fence TTL, and
-- slot i is taken only while every slot below it is held: the first absent marker ends the scan, so an
-- entity no lock_limit task ever used costs one EXISTS. Names built from the given ones keep the {K} tag.
-- Returns the held slot freeing last (the one an exclusive holder waits for) and how many are held, or nil.
local function held_slot(lock_key, fence_key)
  local last, last_pttl, count = nil, -1, 0
  local i = 1
  while i < 256 and redis.call('EXISTS', fence_key .. ':' .. i) == 1 do
    local pttl = redis.call('PTTL', lock_key .. ':' .. i)  -- -2: free; -1 (no expiry): frees last
    if pttl == -1 then pttl = 2^52 end
    if pttl ~= -2 then
      count = count + 1
      if pttl > last_pttl then last, last_pttl = i, pttl end
    end
    i = i + 1
  end
  return last, count
end
-- The 'held' reply (ACQUIRE's layout, plus slot and busy as ACQUIRE_SLOTS) for slot i of lock_key.
local function held_slot_reply(lock_key, i, count, now_ms)
  local key = lock_key .. ':' .. i
  local h = redis.call('HMGET', key, 'token', 'task_id', 'task_name', 'digest', 'host', 'pid', 'state',
                       'renewed_at', 'ttl')
  local age = now_ms - (tonumber(h[8]) or now_ms)
  return {'held', h[2] or '', h[3] or '', h[4] or '', h[5] or '', h[6] or '', h[7] or '',
          redis.call('PTTL', key), age, h[1] or '', tonumber(h[9]) or 0, i, count}
end
"""

#: Lua: a script that writes in a loop checks, before its first write, every key it will touch that a
#: command could refuse for its type: Redis does not roll back a script's writes before an error, so a
#: WRONGTYPE part way through (a string planted at the second entity) would leave the first entity freed and
#: its waiter reserved with the reply, and so the wake, lost. wrong_type(key, kind) is nil when ``key`` is
#: absent or a ``kind`` ('hash' or 'list'), else the WRONGTYPE error reply text naming the key. It reads with
#: commands the scripts already call (HGET, LINDEX): no ACL grant beyond acl.IN_SCRIPTS.
_WRONG_TYPE = """
local function wrong_type(key, kind)
  local r
  if kind == 'list' then r = redis.pcall('LINDEX', key, 0) else r = redis.pcall('HGET', key, 'token') end
  if type(r) == 'table' and r.err then return r.err .. ' (' .. key .. ')' end
  return nil
end
"""

ACQUIRE = (
    """
-- ACQUIRE: take the lease on entity K if it is free (SET NX PX semantics on a hash),
-- checking the completion record first. One round trip.
-- KEYS[1] lease hash       {prefix}:v1:{K}:lock
-- KEYS[2] fence counter    {prefix}:v1:{K}:fence
-- KEYS[3] queue claim      {prefix}:v1:{K}:claim  (until_started; deleted on success if ARGV[12] owns it)
-- KEYS[4] completion rec.  {prefix}:v1:{S}:done   (absent when completion is off or stored elsewhere)
-- ARGV[1] token (random per acquisition)   ARGV[2] ttl_ms
-- ARGV[3] task_id  ARGV[4] task_name  ARGV[5] args digest
-- ARGV[6] host  ARGV[7] pid  ARGV[8] worker nodename  ARGV[9] state (running|queued)
-- ARGV[10] fence_ttl_ms
-- ARGV[11] replace_token: take over a lease that still carries this token ('' = never);
--          how the worker adopts its own queue claim (until_done) or a dead holder of its id
-- ARGV[12] claim token: free the until_started claim in KEYS[3] once acquired ('' = none)
-- The single lease is exclusive against the slot leases of a lock_limit task on K (shared holders, as a
-- read/write lock): a held slot {K}:lock:<i> (i >= 1; slot 0 is KEYS[1]) refuses it like a holder, also
-- to an adopting replace_token. Found by the fence markers {K}:fence:<i> (KEYS[2] .. ':' .. i): one EXISTS
-- when no lock_limit task ever used K.
-- Returns:
--   {'done', record}     a completion record exists: nothing acquired
--   {'ok', fence}        acquired; fence = max(previous + 1, server time in us)
--   {'held', task_id, task_name, digest, host, pid, state, pttl_ms, ms_since_renewal, token, ttl_ms}
--                        ttl_ms: the holder's own lease TTL (hash field ttl; 0 if missing)
--   {'held', ..., ttl_ms, slot, busy}  a slot lease (slot >= 1) is held: the one that frees last, and
--                        how many slots are held; nothing written
-- Errors (nothing written): 'LOCKGUARD_CORRUPT_FENCE <fence key> <value>' when a fence must be
--   issued and KEYS[2] is not an integer below 2^53-1 (Lua numbers are doubles: no exact next fence);
--   'WRONGTYPE ...' for KEYS[1] or KEYS[4] of another type (read before any write), and for KEYS[3] (read
--   after the lease is written when ARGV[12] is given) of another type: checked before the first write
"""
    + _NOW
    + _NEXT_FENCE
    + _HELD_SLOTS
    + _WRONG_TYPE
    + """
if KEYS[4] then
  local rec = redis.call('GET', KEYS[4])
  if rec then return {'done', rec} end
end
local cur = redis.call('HMGET', KEYS[1], 'token', 'task_id', 'task_name', 'digest', 'host', 'pid',
                       'state', 'renewed_at', 'fence', 'ttl')
if cur[1] then
  if cur[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {'ok', cur[9]}
  end
  if ARGV[11] == '' or cur[1] ~= ARGV[11] then
    local age = now_ms - (tonumber(cur[8]) or now_ms)
    return {'held', cur[2] or '', cur[3] or '', cur[4] or '', cur[5] or '', cur[6] or '', cur[7] or '',
            redis.call('PTTL', KEYS[1]), age, cur[1], tonumber(cur[10]) or 0}
  end
end
local slot, busy = held_slot(KEYS[1], KEYS[2])
if slot then return held_slot_reply(KEYS[1], slot, busy, now_ms) end
local bad, last = corrupt_fence(KEYS[2])
if bad then return redis.error_reply(bad) end
if ARGV[12] ~= '' then  -- the claim is read after the lease is written: its type is checked before
  bad = wrong_type(KEYS[3], 'hash')
  if bad then return redis.error_reply(bad) end
end
local fence = next_fence(KEYS[2], ARGV[10], now_us, last)
if cur[1] then redis.call('DEL', KEYS[1]) end  -- replacing: drop the old holder's fields
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'task_name', ARGV[4],
           'digest', ARGV[5], 'host', ARGV[6], 'pid', ARGV[7], 'worker', ARGV[8], 'state', ARGV[9],
           'acquired_at', now_ms, 'renewed_at', now_ms, 'ttl', ARGV[2], 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[12] ~= '' and redis.call('HGET', KEYS[3], 'token') == ARGV[12] then
  redis.call('DEL', KEYS[3])
end
return {'ok', fence}
"""
)

ACQUIRE_SLOTS = (
    """
-- ACQUIRE_SLOTS: take one of N slot leases on entity K (lock_limit), admitted by K's sliding start
-- window (lock_rate), after the completion check. One round trip, whatever N. Used only by tasks with
-- lock_limit > 1 or a lock_rate; the single lease (N = 1, no rate) stays on ACQUIRE, byte for byte.
-- Slot i is a lease hash of its own (as ACQUIRE writes it, plus 'slot', 'limit', 'rate', 'window': what
-- `lockguard locks` reads to show slots held N/M and the window's use) with a fence counter of
-- its own; slot 0 is K's plain lease hash and fence, so N = 1 with a rate keeps the same keys.
-- KEYS[1..N]      slot lease hashes    {prefix}:v1:{K}:lock, {prefix}:v1:{K}:lock:<i> (i = 1..N-1)
-- KEYS[N+1..2N]   slot fence counters  {prefix}:v1:{K}:fence, {prefix}:v1:{K}:fence:<i>
-- KEYS[2N+1]      start window         {prefix}:v1:{K}:rate (ZSET token -> start ms; only with ARGV[13] > 0)
-- KEYS[2N+2]      completion record    {prefix}:v1:{S}:done (absent when completion is off or stored elsewhere)
-- ARGV[1..10] as ACQUIRE (token, ttl_ms, task_id, task_name, digest, host, pid, worker, state, fence_ttl_ms)
-- ARGV[11] replace_token: take over the slot that still carries this token ('' = never)
-- ARGV[12] N, the slots (>= 1)   ARGV[13] starts admitted per window (0 = no rate)   ARGV[14] window ms
-- Returns:
--   {'done', record}         a completion record exists: nothing acquired
--   {'ok', fence, slot}      acquired slot (0-based); re-sent with the same token: the same slot, renewed
--   {'held', task_id, task_name, digest, host, pid, state, pttl_ms, ms_since_renewal, token, ttl_ms, slot, busy}
--                            as ACQUIRE's 'held', for the holder met: a slot carrying this task id or identical
--                            work (task name and digest), which wins over a free slot (the duplicate rule reads
--                            it), else, all N slots being taken, the one that frees first; busy = slots taken
--   {'throttled', wait_ms, starts}  a slot is free but ARGV[13] starts fell in the last ARGV[14] ms: nothing
--                            written but the window's trim; wait_ms until its oldest start leaves the window
-- The window holds at most ARGV[13] members (one per admitted start, added only below the bound), trimmed
-- to the window on every call, PX = the window: memory per entity is bounded by the rate.
-- Exclusive holders: KEYS[1] held by anything but a slot lease (no 'slot' field: the single lease of a task
-- without lock_limit, an until_done claim, a workflow, a waiter's reservation) refuses every slot, as a
-- write lock refuses readers: 'held' names it (slot 0), unless identical work or this task id holds a slot.
-- Slots past N (a deploy lowered N while the old N's bodies hold them) are read for the duplicate rule only:
-- their names are built here from KEYS[1] and KEYS[N+1] (same {K} tag); 'held' may then name slot >= N.
-- Errors (nothing written): 'LOCKGUARD_CORRUPT_FENCE <fence key> <value>' as ACQUIRE, for the slot taken
"""
    + _NOW
    + _NEXT_FENCE
    + """
local n = tonumber(ARGV[12])
local rate_key = KEYS[2 * n + 1]
local done_key = KEYS[2 * n + 2]
if done_key then
  local rec = redis.call('GET', done_key)
  if rec then return {'done', rec} end
end
local cur, free, replace, conflict, soonest, soonest_pttl, busy = {}, nil, nil, nil, nil, nil, 0
local exclusive = false
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], 'token', 'task_id', 'task_name', 'digest', 'host', 'pid',
                       'state', 'renewed_at', 'fence', 'ttl', 'slot')
  cur[i] = h
  if i == 1 and h[1] and not h[11] and h[1] ~= ARGV[1] and (ARGV[11] == '' or h[1] ~= ARGV[11]) then
    exclusive = true
  end
  if h[1] then
    if h[1] == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
      return {'ok', h[9], i - 1}
    end
    busy = busy + 1
    if ARGV[11] ~= '' and h[1] == ARGV[11] then replace = i end
    if not conflict and (h[2] == ARGV[3] or (h[3] == ARGV[4] and h[4] == ARGV[5])) then conflict = i end
    local pttl = redis.call('PTTL', KEYS[i])
    if not soonest or pttl < soonest_pttl then soonest, soonest_pttl = i, pttl end
  elseif not free then
    free = i
  end
end
-- Slots past N: a deploy lowered lock_limit while a body of the old N still holds slot i >= N. They are
-- read for the duplicate rule only (a redelivery or identical work held there must not run again in a
-- slot below N). Slot i is taken only while every slot below it is, so its fence counter
-- {K}:fence:<i> (kept fence_ttl, far beyond any lease) marks how far to look: the first absent one
-- ends the scan, one EXISTS when N never changed. Names built here keep the {K} tag: same Cluster slot.
local slot_key = {}
local i = n
while not conflict and i < 256 and redis.call('EXISTS', KEYS[n + 1] .. ':' .. i) == 1 do
  local key = KEYS[1] .. ':' .. i
  local h = redis.call('HMGET', key, 'token', 'task_id', 'task_name', 'digest', 'host', 'pid',
                       'state', 'renewed_at', 'fence', 'ttl')
  if h[1] and ARGV[11] ~= '' and h[1] == ARGV[11] then
    redis.call('DEL', key)  -- our own orphan or dead holder there, to take over: it goes, we take a slot below N
  elseif h[1] and (h[2] == ARGV[3] or (h[3] == ARGV[4] and h[4] == ARGV[5])) then
    cur[i + 1], slot_key[i + 1], conflict = h, key, i + 1
  end
  i = i + 1
end
local function held(i)
  local h = cur[i]
  local age = now_ms - (tonumber(h[8]) or now_ms)
  return {'held', h[2] or '', h[3] or '', h[4] or '', h[5] or '', h[6] or '', h[7] or '',
          redis.call('PTTL', slot_key[i] or KEYS[i]), age, h[1], tonumber(h[10]) or 0, i - 1, busy}
end
local slot = replace
if not slot then
  if conflict then return held(conflict) end
  if exclusive then return held(1) end
  if not free then return held(soonest) end
  slot = free
end
local rate = tonumber(ARGV[13]) or 0
local window = tonumber(ARGV[14]) or 0
if rate > 0 then
  redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', now_ms - window)
  local starts = redis.call('ZCARD', rate_key)
  if starts >= rate then
    local oldest = redis.call('ZRANGE', rate_key, 0, 0, 'WITHSCORES')
    return {'throttled', math.max(1, tonumber(oldest[2]) + window - now_ms), starts}
  end
end
local fence_key = KEYS[n + slot]
local bad, last = corrupt_fence(fence_key)
if bad then return redis.error_reply(bad) end
local fence = next_fence(fence_key, ARGV[10], now_us, last)
if cur[slot][1] then redis.call('DEL', KEYS[slot]) end  -- replacing: drop the old holder's fields
redis.call('HSET', KEYS[slot], 'token', ARGV[1], 'task_id', ARGV[3], 'task_name', ARGV[4],
           'digest', ARGV[5], 'host', ARGV[6], 'pid', ARGV[7], 'worker', ARGV[8], 'state', ARGV[9],
           'acquired_at', now_ms, 'renewed_at', now_ms, 'ttl', ARGV[2], 'fence', fence, 'slot', slot - 1,
           'limit', n, 'rate', rate, 'window', window)
redis.call('PEXPIRE', KEYS[slot], ARGV[2])
if rate > 0 then
  redis.call('ZADD', rate_key, now_ms, ARGV[1])
  redis.call('PEXPIRE', rate_key, window)
end
return {'ok', fence, slot - 1}
"""
)

ACQUIRE_MULTI = (
    """
-- ACQUIRE_MULTI: take the leases of several entities (lock_key as a sequence) atomically: every one or
-- none. Per entity exactly ACQUIRE's rules and hash fields (holder, state, fence, adoption of a lease
-- carrying replace_token, exclusion against lock_limit slot leases), plus the field 'siblings'. One token
-- for the whole acquisition. The keys of every entity must share a slot (one Redis; on Cluster, one
-- entity per call: celery_lockguard._multi acquires in sorted order and rolls back). One round trip.
-- N = ARGV[13] entities, in the caller's order (sorted entity keys; entity 1 is the anchor).
-- KEYS[1..N]      lease hashes      {prefix}:v1:{K_i}:lock
-- KEYS[N+1..2N]   fence counters    {prefix}:v1:{K_i}:fence
-- KEYS[2N+1]      queue claim of the anchor {prefix}:v1:{K_1}:claim (deleted on success if ARGV[12] owns it)
-- KEYS[2N+2]      completion record {prefix}:v1:{S}:done (absent when completion is off or stored elsewhere)
-- ARGV[1..12] as ACQUIRE (token, ttl_ms, task_id, task_name, digest, host, pid, worker, state,
--          fence_ttl_ms, replace_token, claim token)
-- ARGV[13] N  ARGV[13+i] 'siblings' of entity i: a JSON array of the OTHER entity keys of this acquisition
-- Returns:
--   {'done', record}                 a completion record exists: nothing acquired
--   {'ok', fence_1, ..., fence_N}    every entity acquired (an entity already carrying ARGV[1], a re-sent
--                                    call, keeps its fence and is renewed); each fence as ACQUIRE's
--   {'blocked', i, held}             entity i is held (the first in order that is): nothing written;
--                                    held = ACQUIRE's 'held' reply for it (slot leases included)
-- Errors (nothing written): 'LOCKGUARD_CORRUPT_FENCE <fence key> <value>' as ACQUIRE, for any entity;
--   'WRONGTYPE ...' for a lease hash or the completion record of another type (read before any write), and
--   for a claim (KEYS[2N+1], read after the leases are written when ARGV[12] is given) of another type:
--   checked before the first write, so no lease is left taken for a delivery that gets an error
"""
    + _NOW
    + _NEXT_FENCE
    + _HELD_SLOTS
    + _WRONG_TYPE
    + """
local n = tonumber(ARGV[13])
local done_key = KEYS[2 * n + 2]
if done_key then
  local rec = redis.call('GET', done_key)
  if rec then return {'done', rec} end
end
local cur = {}
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], 'token', 'task_id', 'task_name', 'digest', 'host', 'pid',
                       'state', 'renewed_at', 'fence', 'ttl')
  cur[i] = h
  if h[1] and h[1] ~= ARGV[1] then
    if ARGV[11] == '' or h[1] ~= ARGV[11] then
      local age = now_ms - (tonumber(h[8]) or now_ms)
      return {'blocked', i, {'held', h[2] or '', h[3] or '', h[4] or '', h[5] or '', h[6] or '', h[7] or '',
              redis.call('PTTL', KEYS[i]), age, h[1], tonumber(h[10]) or 0}}
    end
  end
  if h[1] ~= ARGV[1] then
    local slot, busy = held_slot(KEYS[i], KEYS[n + i])
    if slot then return {'blocked', i, held_slot_reply(KEYS[i], slot, busy, now_ms)} end
  end
end
for i = 1, n do
  if cur[i][1] ~= ARGV[1] then
    local bad = corrupt_fence(KEYS[n + i])
    if bad then return redis.error_reply(bad) end
  end
end
if ARGV[12] ~= '' then  -- the claim is read after the leases are written: its type is checked before
  local bad = wrong_type(KEYS[2 * n + 1], 'hash')
  if bad then return redis.error_reply(bad) end
end
local out = {'ok'}
for i = 1, n do
  if cur[i][1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    out[i + 1] = cur[i][9]
  else
    local fence = next_fence(KEYS[n + i], ARGV[10], now_us)
    if cur[i][1] then redis.call('DEL', KEYS[i]) end  -- replacing: drop the old holder's fields
    redis.call('HSET', KEYS[i], 'token', ARGV[1], 'task_id', ARGV[3], 'task_name', ARGV[4],
               'digest', ARGV[5], 'host', ARGV[6], 'pid', ARGV[7], 'worker', ARGV[8], 'state', ARGV[9],
               'acquired_at', now_ms, 'renewed_at', now_ms, 'ttl', ARGV[2], 'fence', fence,
               'siblings', ARGV[13 + i])
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    out[i + 1] = fence
  end
end
if ARGV[12] ~= '' and redis.call('HGET', KEYS[2 * n + 1], 'token') == ARGV[12] then
  redis.call('DEL', KEYS[2 * n + 1])
end
return out
"""
)

#: Lua: the one wake-up every lease end shares (RELEASE, FORCE_RELEASE, WAKE; _handoff's module docstring).
#: wake_oldest(queue, entries, freed, reserve_ms) hands the lease hash ``freed`` (K's lease or one of its
#: lock_limit slots, which the caller has just seen free, or freed) to the oldest live waiter, as a
#: reservation (token = park token, state 'handed', PX reserve_ms); marks its entry 'waking' (waking_at =
#: now) and returns {park token, message}; nil when no waiter can be woken now. A *shared* waiter (k:P =
#: 's', a lock_limit task's) takes ``freed`` itself, the slot that came free; an *exclusive* one (the single
#: lease, which excludes every slot) takes K's lease, and only once the entity is wholly free (K's lease
#: and every slot, :data:`_HELD_SLOTS`): until then it stays first and nobody behind it is woken (FIFO,
#: as a write lock's queue). Stale entries met at the head (state not 'parked', or past their deadline)
#: are dropped. Needs now_ms (_NOW) and held_slot (_HELD_SLOTS, included before it).
_WAKE_OLDEST = """
local function wake_oldest(queue, entries, freed, reserve_ms)
  local lock_key = string.match(freed, '^(.*}:lock):%d+$') or freed
  local fence_key = string.sub(lock_key, 1, #lock_key - 4) .. 'fence'  -- {K}:fence; slot i's marker: ':<i>' after
  while true do
    local p = redis.call('LINDEX', queue, 0)
    if not p then return nil end
    local e = redis.call('HMGET', entries, 's:' .. p, 'd:' .. p, 'm:' .. p, 't:' .. p, 'n:' .. p, 'g:' .. p,
                         'k:' .. p)
    if e[1] == 'parked' and (tonumber(e[2]) or 0) >= now_ms and e[3] then
      local target, slot = freed, false
      if e[7] == 's' then
        slot = true
        -- a slot and the single lease exclude each other: while {K}:lock is held by anything but a slot
        -- lease (the single lease, a claim, an exclusive waiter's reservation), no slot i >= 1 is handed
        -- out (a RELEASE of a slot already gone, a WAKE): the waiter stays parked, that holder's end wakes it
        if target ~= lock_key then
          local x = redis.call('HMGET', lock_key, 'token', 'slot')
          if x[1] and not x[2] then return nil end
        end
      else
        target = lock_key
        if redis.call('EXISTS', lock_key) == 1 then return nil end
        if held_slot(lock_key, fence_key) then return nil end
      end
      redis.call('LPOP', queue)
      redis.call('HSET', target, 'token', p, 'task_id', e[4] or '', 'task_name', e[5] or '', 'digest', e[6] or '',
                 'host', '', 'pid', 0, 'worker', '', 'state', 'handed', 'acquired_at', now_ms,
                 'renewed_at', now_ms, 'ttl', reserve_ms, 'fence', '')
      -- a shared waiter's reservation is a slot: it refuses the single lease, not the other slots
      if slot then redis.call('HSET', target, 'slot', string.match(target, ':(%d+)$') or 0) end
      redis.call('PEXPIRE', target, reserve_ms)
      if slot and target ~= lock_key then
        -- slot i >= 1 is found by its marker {K}:fence:<i> (held_slot): a slot never taken before has none,
        -- and the single lease would be taken beside this reservation. The marker is the slot's fence
        -- counter: '0' lets the next fence be drawn from the clock. It lives as long as slot 0's counter
        -- {K}:fence (held now: the fence TTL), as a marker a taken slot leaves does: a slot taken above it
        -- while it stands stays visible after this reservation lapses, since every scan stops at the
        -- first missing marker.
        local marker = fence_key .. ':' .. string.match(target, ':(%d+)$')
        if redis.call('EXISTS', marker) == 0 then
          redis.call('SET', marker, '0', 'PX', math.max(redis.call('PTTL', fence_key), reserve_ms))
        end
      end
      redis.call('HSET', entries, 's:' .. p, 'waking', 'w:' .. p, now_ms)
      return {p, e[3]}
    end
    redis.call('LPOP', queue)
    if e[1] == 'parked' or not e[1] then
      redis.call('HDEL', entries, 's:' .. p, 'd:' .. p, 'm:' .. p, 't:' .. p, 'n:' .. p, 'g:' .. p, 'w:' .. p,
                 'o:' .. p, 'k:' .. p)
    end
  end
end
"""

RELEASE = (
    """
-- RELEASE: delete the lease only if it still carries our token, and record completion
-- (even when the lease was lost: the body did run); when it deleted our lease and the wake
-- keys are given, hand the entity to the oldest live waiter (park and wake). One round trip.
-- KEYS[1] lease hash
-- KEYS[2] waiter queue   {prefix}:v1:{K}:wait     (with KEYS[3]; both absent: nobody is woken)
-- KEYS[3] waiter entries {prefix}:v1:{K}:waiters
-- KEYS[4] completion record (absent when nothing is recorded or it lives in another slot)
-- ARGV[1] token  ARGV[2] completion record (JSON)  ARGV[3] completion_ttl_ms
-- ARGV[4] reservation ttl_ms for a woken waiter ('' or 0: nobody is woken)
-- ARGV[5] ignored (the slot KEYS[1] is; wake_oldest reads it from KEYS[1]'s name)
--   Who is woken (wake_oldest): a shared (lock_limit) waiter into KEYS[1] itself, the slot that came
--   free; an exclusive one (the single lease) into {K}:lock once the entity is wholly free ({K}:lock and
--   every slot {K}:lock:<i>, found by the fence markers {K}:fence:<i>). Names keep KEYS[1]'s {K} tag.
-- Returns {released, recorded} or {released, recorded, park_token, entry}
--   released: 1 deleted; 0 the key was gone (expired); -1 another token holds it (left alone).
--   The oldest waiter is woken when the lease is free afterwards (released 1 or 0): a lease that
--   expired under its holder ends with its release too, so its waiters need not wait for their safety copies.
--   recorded: 1 record written; 0 none asked, or an earlier record was kept (first wins)
--   park_token, entry: the waiter woken. Stale entries met on the way (state not 'parked', or past
--   their deadline) are dropped. The lease hash becomes its reservation (token = park_token,
--   state 'handed', PX ARGV[4]) and its entry 'waking' (waking_at = now): the releaser publishes
--   the entry's message, then CONFIRM_WAKE makes it 'woken'.
-- The server's TIME is read only when a waiter is queued (wake_oldest needs now_ms): not on the uncontended path.
local now_ms = nil
"""
    + _HELD_SLOTS
    + _WAKE_OLDEST
    + """
local released = 0
local token = redis.call('HGET', KEYS[1], 'token')
if token == ARGV[1] then
  redis.call('DEL', KEYS[1])
  released = 1
elseif token then
  released = -1
end
local recorded = 0
if KEYS[4] then
  if redis.call('SET', KEYS[4], ARGV[2], 'NX', 'PX', ARGV[3]) then recorded = 1 end
end
local reserve_ms = tonumber(ARGV[4] or '') or 0
if released == -1 or not KEYS[3] or reserve_ms <= 0 then return {released, recorded} end
if not redis.call('LINDEX', KEYS[2], 0) then return {released, recorded} end  -- nobody waits
local t = redis.call('TIME')
now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local woken = wake_oldest(KEYS[2], KEYS[3], KEYS[1], reserve_ms)
if woken then return {released, recorded, woken[1], woken[2]} end
return {released, recorded}
"""
)

RELEASE_MULTI = (
    """
-- RELEASE_MULTI: end a multi-entity lease (ACQUIRE_MULTI): record completion first, then per entity delete
-- the lease only if it still carries the token and, when it is free afterwards, hand it to that entity's
-- oldest live waiter (wake_oldest, exactly as RELEASE). One round trip; every key must share a slot (on
-- Cluster: one entity per call).
-- N = ARGV[5] entities. KEYS[3i-2] lease hash of entity i  KEYS[3i-1] its waiter queue {K_i}:wait
-- KEYS[3i] its waiter entries {K_i}:waiters   KEYS[3N+1] completion record (absent: nothing recorded here)
-- ARGV[1] token  ARGV[2] completion record (JSON)  ARGV[3] completion_ttl_ms
-- ARGV[4] reservation ttl_ms for a woken waiter ('' or 0: nobody is woken)  ARGV[5] N
-- Returns {recorded, {released_1, ..., released_N}, {i, park_token, entry, ...}}
--   recorded: 1 record written; 0 none asked, or an earlier record was kept (first wins)
--   released_i: 1 deleted; 0 the key was gone (expired); -1 another token holds it (left alone)
--   then one (i, park token, entry) triple per entity whose oldest waiter was woken (publish its entry)
-- Errors (nothing written, nothing recorded: every entity lapses by its TTL): 'WRONGTYPE ... (<key>)' when a
--   lease hash, or a waiter queue or entries key it would wake from, is of another type. Checked for every
--   entity before the first write: an error part way would free the entities before it and reserve their
--   waiters, the reply (and so their wake) lost.
"""
    + _NOW
    + _HELD_SLOTS
    + _WAKE_OLDEST
    + _WRONG_TYPE
    + """
local n = tonumber(ARGV[5])
local reserve_ms = tonumber(ARGV[4] or '') or 0
for i = 1, n do
  local bad = wrong_type(KEYS[3 * i - 2], 'hash')
  local token = not bad and redis.call('HGET', KEYS[3 * i - 2], 'token')
  if not bad and reserve_ms > 0 and (not token or token == ARGV[1]) then  -- free afterwards: it wakes
    bad = wrong_type(KEYS[3 * i - 1], 'list')
    if not bad and redis.call('LINDEX', KEYS[3 * i - 1], 0) then bad = wrong_type(KEYS[3 * i], 'hash') end
  end
  if bad then return redis.error_reply(bad) end
end
local recorded = 0
if KEYS[3 * n + 1] then
  if redis.call('SET', KEYS[3 * n + 1], ARGV[2], 'NX', 'PX', ARGV[3]) then recorded = 1 end
end
local released, woken = {}, {}
for i = 1, n do
  local key = KEYS[3 * i - 2]
  local token = redis.call('HGET', key, 'token')
  released[i] = 0
  if token == ARGV[1] then
    redis.call('DEL', key)
    released[i] = 1
  elseif token then
    released[i] = -1
  end
  if released[i] ~= -1 and reserve_ms > 0 then
    local w = wake_oldest(KEYS[3 * i - 1], KEYS[3 * i], key, reserve_ms)
    if w then
      woken[#woken + 1] = i
      woken[#woken + 1] = w[1]
      woken[#woken + 1] = w[2]
    end
  end
end
return {recorded, released, woken}
"""
)

KEEP_BEFORE = (
    """
-- KEEP_BEFORE: a woken multi-entity waiter whose ACQUIRE_MULTI met entity B held parks on B; of the
-- reservations it holds (token ARGV[1]) it KEEPS those on entities sorted before B (re-tokened to its new
-- park token ARGV[2], state 'handed', PX ARGV[3]: its safety copy's countdown + the wake grace, so a killed
-- waiter's reservation still lapses) and GIVES BACK the others (deleted, each freed entity's oldest waiter
-- woken, as RELEASE_MULTI). Entities are passed in sorted order, so waits only ever point up that order:
-- no cycle (deadlock-free), and two woken waiters never give their reservations to each other forever.
-- One round trip; every key must share a slot (on Cluster: one entity per call).
-- N = ARGV[5] entities. KEYS[3i-2] lease hash of entity i  KEYS[3i-1] its waiter queue {K_i}:wait
-- KEYS[3i] its waiter entries {K_i}:waiters
-- ARGV[1] the reservations' token (the park token the woken copy came with)  ARGV[2] the new park token
-- ARGV[3] keep_ms  ARGV[4] reservation ttl_ms for a woken waiter  ARGV[5] N
-- ARGV[6] K: entities 1..K are kept (those sorted before the blocker), K+1..N given back (K = 0: all)
-- Returns {{code_1, ..., code_N}, {i, park_token, entry, ...}}
--   code_i: 2 kept (re-tokened); 1 given back (deleted); 0 not ours (another token or none: left alone)
--   then one (i, park token, entry) triple per given-back entity whose oldest waiter was woken
-- Errors (nothing written: every reservation lapses by its TTL): 'WRONGTYPE ... (<key>)' when a lease hash,
--   or the waiter queue or entries key of an entity it would give back, is of another type. Checked for
--   every entity before the first write: an error part way would leave the entities before it kept or given
--   back (their waiters reserved) with the reply, and so those wakes, lost.
"""
    + _NOW
    + _HELD_SLOTS
    + _WAKE_OLDEST
    + _WRONG_TYPE
    + """
local n, k = tonumber(ARGV[5]), tonumber(ARGV[6])
local reserve_ms = tonumber(ARGV[4] or '') or 0
for i = 1, n do
  local bad = wrong_type(KEYS[3 * i - 2], 'hash')
  if not bad and i > k and reserve_ms > 0 and redis.call('HGET', KEYS[3 * i - 2], 'token') == ARGV[1] then
    bad = wrong_type(KEYS[3 * i - 1], 'list')
    if not bad and redis.call('LINDEX', KEYS[3 * i - 1], 0) then bad = wrong_type(KEYS[3 * i], 'hash') end
  end
  if bad then return redis.error_reply(bad) end
end
local codes, woken = {}, {}
for i = 1, n do
  local key = KEYS[3 * i - 2]
  codes[i] = 0
  if redis.call('HGET', key, 'token') == ARGV[1] then
    if i <= k then
      redis.call('HSET', key, 'token', ARGV[2], 'state', 'handed', 'renewed_at', now_ms, 'ttl', ARGV[3])
      redis.call('PEXPIRE', key, ARGV[3])
      codes[i] = 2
    else
      redis.call('DEL', key)
      codes[i] = 1
      if reserve_ms > 0 then
        local w = wake_oldest(KEYS[3 * i - 1], KEYS[3 * i], key, reserve_ms)
        if w then
          woken[#woken + 1] = i
          woken[#woken + 1] = w[1]
          woken[#woken + 1] = w[2]
        end
      end
    end
  end
end
return {codes, woken}
"""
)

RENEW = (
    """
-- RENEW: extend every lease this process holds, in one round trip per tick.
-- KEYS[i] lease hash of lease i
-- ARGV[2i-1] token of lease i   ARGV[2i] ttl_ms of lease i
-- Returns {r1, ..., rn}: 1 renewed; 0 the token is gone (the lease is lost; nothing written)
"""
    + _NOW
    + """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'token') == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', key, ARGV[2 * i])
    redis.call('HSET', key, 'renewed_at', now_ms)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

SHORTEN = """
-- SHORTEN: from the worker's main process (hard time limit, terminate), which has no token:
-- cut the lease held by this task on this host down to a short grace; never lengthen it.
-- KEYS[1] lease hash
-- ARGV[1] task_id  ARGV[2] host  ARGV[3] grace_ms
-- ARGV[4] pid of the child that ran the task ('' = any): a same-host holder of the same task id in
--         another process (a redelivery that took the lease over) is left alone
-- Returns 1 shortened (or already shorter), 0 not held by that task on that host (and pid)
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'host', 'pid')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
if ARGV[4] and ARGV[4] ~= '' and cur[3] ~= ARGV[4] then return 0 end
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 0 or pttl > tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

FORCE_RELEASE = (
    """
-- FORCE_RELEASE: an operator evicts whoever holds K and bumps the fence, so the evicted
-- holder's later fenced writes are rejected; then, as RELEASE does, hands the entity to its oldest
-- live waiter (a forced release is a lease end like any other: it wakes).
-- KEYS[1] lease hash   KEYS[2] fence counter
-- KEYS[3] waiter queue {prefix}:v1:{K}:wait   KEYS[4] waiter entries {prefix}:v1:{K}:waiters
--         (both absent: nobody is woken)
-- ARGV[1] fence_ttl_ms  ARGV[2] reservation ttl_ms for a woken waiter ('' or 0: nobody is woken)
-- Returns {deleted (1|0), new fence, evicted task_id or ''} or, when a waiter was woken,
--   {deleted, new fence, evicted task_id, park_token, entry} (as RELEASE's: publish the entry's message)
-- Errors (nothing written, the holder is left alone): 'LOCKGUARD_CORRUPT_FENCE <fence key> <value>'
--   when KEYS[2] is not an integer below 2^53-1
"""
    + _NOW
    + _NEXT_FENCE
    + _HELD_SLOTS
    + _WAKE_OLDEST
    + """
local bad, last = corrupt_fence(KEYS[2])
if bad then return redis.error_reply(bad) end
local holder = redis.call('HGET', KEYS[1], 'task_id') or ''
local deleted = redis.call('DEL', KEYS[1])
local fence = next_fence(KEYS[2], ARGV[1], now_us, last)
local reserve_ms = tonumber(ARGV[2] or '') or 0
if KEYS[4] and reserve_ms > 0 then
  local woken = wake_oldest(KEYS[3], KEYS[4], KEYS[1], reserve_ms)
  if woken then return {deleted, fence, holder, woken[1], woken[2]} end
end
return {deleted, fence, holder}
"""
)

WAKE = (
    """
-- WAKE: a lease ended with no RELEASE to wake its waiters (cut short from the worker's main process,
-- expired under a killed holder, a workflow's lease freed by WORKFLOW_ABORT): if the entity is free
-- now, hand it to its oldest live waiter exactly as RELEASE does.
-- KEYS[1] waiter queue {prefix}:v1:{K}:wait   KEYS[2] waiter entries {prefix}:v1:{K}:waiters
-- KEYS[3..] the entity's lease hashes: K's lease, or the N slot leases of a lock_limit entity
-- ARGV[1] reservation ttl_ms for the woken waiter
-- Returns {'held'} every lease hash is taken (nothing written) | {'none'} free, and no live waiter
--   (stale entries dropped) | {'woken', park_token, entry, index}: KEYS[2 + index] became its reservation
"""
    + _NOW
    + _HELD_SLOTS
    + _WAKE_OLDEST
    + """
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    local woken = wake_oldest(KEYS[1], KEYS[2], KEYS[i], tonumber(ARGV[1]))
    if woken then return {'woken', woken[1], woken[2], i - 2} end
    return {'none'}
  end
end
return {'held'}
"""
)


CLAIM = """
-- CLAIM: at publish time, claim entity K for a message about to be sent (until_started, until_done).
-- KEYS[1] claim hash: the lease hash itself (until_done) or {prefix}:v1:{K}:claim (until_started)
-- KEYS[2] until_done only: {prefix}:v1:{K}:claim, where a message queues while *different* work holds
--         the lease hash (so "one copy queued or running" holds behind other work too)
-- ARGV[1] token  ARGV[2] ttl_ms (queue_lock_ttl, plus the delay of a countdown/eta)
-- ARGV[3] task_id  ARGV[4] task_name  ARGV[5] args digest  ARGV[6] host  ARGV[7] pid
-- ARGV[8] publish_ttl_ms: > 0, the claim is written in state 'publishing' and lives that long until
--         CONFIRM_CLAIM makes it 'queued' for ARGV[2] (a publish that fails or dies never swallows
--         identical work for the queue TTL); '' or 0, written 'queued' at once
-- Returns:
--   {'ok'}    claimed (state publishing or queued), in KEYS[1], or in KEYS[2] behind different work
--   {'own'}   already claimed or held by this task id (a retry or replace): a queued claim's TTL is
--             extended (never shortened); a running lease is left untouched (its TTL is its liveness)
--   {'held', task_id, task_name, digest, state, pttl_ms, host, pid, ms_since_renewal, ttl_ms}   the claim
--             (or lease) identical work holds, or, without KEYS[2], whatever holds KEYS[1]; host, pid, the
--             age of its last renewal and its own TTL tell a running holder's liveness (a dead holder's
--             identical work must not be answered with it)
local function read(key)
  return redis.call('HMGET', key, 'task_id', 'task_name', 'digest', 'state', 'host', 'pid', 'renewed_at', 'ttl')
end
local function own(key, cur)
  if cur[4] == 'queued' and redis.call('PTTL', key) < tonumber(ARGV[2]) then redis.call('PEXPIRE', key, ARGV[2]) end
  return {'own'}
end
local function held(key, cur)
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local age = now_ms - (tonumber(cur[7]) or now_ms)
  return {'held', cur[1], cur[2] or '', cur[3] or '', cur[4] or '', redis.call('PTTL', key), cur[5] or '',
          cur[6] or '', age, tonumber(cur[8]) or 0}
end
local function identical(cur) return cur[2] == ARGV[4] and cur[3] == ARGV[5] end
local function claim(key)
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local publish_ttl = tonumber(ARGV[8] or '') or 0
  local state = 'queued'
  if publish_ttl > 0 then state = 'publishing' end
  redis.call('HSET', key, 'token', ARGV[1], 'task_id', ARGV[3], 'task_name', ARGV[4], 'digest', ARGV[5],
             'host', ARGV[6], 'pid', ARGV[7], 'worker', '', 'state', state, 'acquired_at', now_ms,
             'renewed_at', now_ms, 'ttl', ARGV[2], 'fence', '')
  if publish_ttl > 0 then redis.call('PEXPIRE', key, publish_ttl) else redis.call('PEXPIRE', key, ARGV[2]) end
  return {'ok'}
end
local cur = read(KEYS[1])
local queued = nil
if KEYS[2] then queued = read(KEYS[2]) end
if cur[1] == ARGV[3] then return own(KEYS[1], cur) end
if queued and queued[1] == ARGV[3] then return own(KEYS[2], queued) end
if cur[1] and (not KEYS[2] or identical(cur)) then return held(KEYS[1], cur) end
if queued and queued[1] and (cur[1] or identical(queued)) then return held(KEYS[2], queued) end
if cur[1] then return claim(KEYS[2]) end
return claim(KEYS[1])
"""

RELEASE_CLAIM = """
-- RELEASE_CLAIM: free a queue-time claim that will never be adopted (revoked or expired message),
-- from the worker's main process (which knows the task id but not the token) or from a publisher
-- or a delivery that knows the token of its claim.
-- KEYS[1..n] the claim hashes a message of this mode may hold (until_done: the lease hash and
--            {prefix}:v1:{K}:claim; until_started: {prefix}:v1:{K}:claim)
-- ARGV[1] task_id  ARGV[2] token ('' = any claim of that task id; else only the claim carrying it)
-- Returns 1 freed; 0 not a queued (or publishing) claim of that task (and token); a running lease is
-- never touched here
for _, key in ipairs(KEYS) do
  local cur = redis.call('HMGET', key, 'task_id', 'state', 'token')
  local waiting = cur[2] == 'queued' or cur[2] == 'publishing'
  if cur[1] == ARGV[1] and waiting and (not ARGV[2] or ARGV[2] == '' or cur[3] == ARGV[2]) then
    redis.call('DEL', key)
    return 1
  end
end
return 0
"""

CONFIRM_CLAIM = """
-- CONFIRM_CLAIM: the message of a claim taken in state 'publishing' was published: make it 'queued'
-- for the queue TTL. Identical publishes that met it meanwhile waited instead of being answered.
-- KEYS[1..n] the claim hashes a message of this mode may hold (see RELEASE_CLAIM)
-- ARGV[1] token  ARGV[2] ttl_ms (queue_lock_ttl, plus the delay of a countdown/eta)
-- Returns 1 confirmed; 0 no publishing claim carries the token (the worker adopted it already, or it expired)
for _, key in ipairs(KEYS) do
  local cur = redis.call('HMGET', key, 'token', 'state')
  if cur[1] == ARGV[1] and cur[2] == 'publishing' then
    redis.call('HSET', key, 'state', 'queued')
    redis.call('PEXPIRE', key, ARGV[2])
    return 1
  end
end
return 0
"""

HANDOVER = """
-- HANDOVER: turn a running until_done lease back into a queued claim for its own retry message,
-- so no identical copy can be queued between the retry's publish and its adoption.
-- KEYS[1] lease hash
-- ARGV[1] current token  ARGV[2] new claim token  ARGV[3] ttl_ms
-- Returns 1 handed over; 0 the lease is no longer ours (nothing written)
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[2], 'state', 'queued')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


WATCH_ARM = """
-- WATCH_ARM: keep at most one pending watch copy per running task (see _waits.watch).
-- A watch copy sits unacknowledged through its countdown and may be redelivered; without this,
-- every delivered copy would leave a watch of its own and the copies would multiply.
-- KEYS[1] watch marker  {prefix}:v1:{K}:watch   (same slot as the lease)
-- ARGV[1] task_id  ARGV[2] token of the watch re-arming ('' for the first)  ARGV[3] new token  ARGV[4] ttl_ms
-- Returns 1 armed (publish a watch carrying the new token); 0 another watch of this task is pending
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'token')
if cur[1] == ARGV[1] and cur[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'token', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""


#: Lua: drop stale entries at the head of the waiter queue (KEYS[1] queue, KEYS[2] entries, now_ms set).
_PURGE_STALE_HEAD = """
local function drop(p)
  redis.call('HDEL', KEYS[2], 's:' .. p, 'd:' .. p, 'm:' .. p, 't:' .. p, 'n:' .. p, 'g:' .. p, 'w:' .. p,
             'o:' .. p, 'k:' .. p)
end
local function purge_stale_head()
  while true do
    local head = redis.call('LINDEX', KEYS[1], 0)
    if not head then return end
    local e = redis.call('HMGET', KEYS[2], 's:' .. head, 'd:' .. head)
    if e[1] == 'parked' and (tonumber(e[2]) or 0) >= now_ms then return end
    redis.call('LPOP', KEYS[1])
    if e[1] == 'parked' or not e[1] then drop(head) end
  end
end
"""

PARK = (
    """
-- PARK: append a waiter behind a live holder of entity K, unless the lease is already gone.
-- KEYS[1] waiter queue   {prefix}:v1:{K}:wait     (list of park tokens, oldest first)
-- KEYS[2] waiter entries {prefix}:v1:{K}:waiters  (hash; per park token P: m:P message, s:P state,
--         d:P deadline ms, t:P task id, n:P task name, g:P args digest, w:P waking_at ms,
--         o:P when the delivery first parked, ms)
-- KEYS[3..] lease hashes {prefix}:v1:{K}:lock, or the N slot leases of a lock_limit entity (all must be
--         taken for the delivery to park: a free one means acquire now)
-- ARGV[1] park token P  ARGV[2] message (JSON: what the releaser re-publishes)
-- ARGV[3] task_id  ARGV[4] task_name  ARGV[5] args digest
-- ARGV[6] entry lifetime ms: past it a still-parked entry is stale (never woken; its copy decides afresh)
-- ARGV[7] keys ttl ms (both waiter keys; extended, never shortened)  ARGV[8] most waiters per entity
-- ARGV[9] when this delivery first parked (ms; '' = now): a copy parking again (its holder outlived a
--         whole safety countdown) goes back ahead of every waiter that parked after it, not to the tail
-- Returns {'parked', pttl_ms} (the holder that frees first) | {'free'} (acquire now) | {'full', waiters}
-- Stale entries at the head of the queue are dropped first. The waiter's kind is kept as k:P: with KEYS[3]
-- alone it is *exclusive* (the single lease): a slot lease of a lock_limit task held on K ({K}:lock:<i>,
-- found by the fence markers {K}:fence:<i> named from KEYS[3]) is a holder too, and the release that
-- leaves the entity wholly free wakes it. With the N slot leases it is *shared* ('s'): any free slot means
-- acquire now, unless K's lease is held by an exclusive holder (no 'slot' field), which refuses every slot.
"""
    + _NOW
    + _PURGE_STALE_HEAD
    + _HELD_SLOTS
    + """
local pttl = nil
if #KEYS == 3 then
  pttl = redis.call('PTTL', KEYS[3])
  if pttl == -2 then
    local slot = held_slot(KEYS[3], string.sub(KEYS[3], 1, #KEYS[3] - 4) .. 'fence')
    if not slot then return {'free'} end
    pttl = redis.call('PTTL', KEYS[3] .. ':' .. slot)
  end
else
  local h = redis.call('HMGET', KEYS[3], 'token', 'slot')
  if h[1] and not h[2] then
    pttl = redis.call('PTTL', KEYS[3])
  else
    for i = 3, #KEYS do
      local t = redis.call('PTTL', KEYS[i])
      if t == -2 then return {'free'} end
      if not pttl or (t >= 0 and t < pttl) then pttl = t end
    end
  end
end
purge_stale_head()
local n = redis.call('LLEN', KEYS[1])
if n >= tonumber(ARGV[8]) then return {'full', n} end
local p = ARGV[1]
local first = tonumber(ARGV[9] or '') or now_ms
local tail = redis.call('LINDEX', KEYS[1], -1)
local after = nil  -- the oldest entry that first parked later than this one
if tail and (tonumber(redis.call('HGET', KEYS[2], 'o:' .. tail)) or 0) > first then
  for _, q in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
    if (tonumber(redis.call('HGET', KEYS[2], 'o:' .. q)) or 0) > first then after = q break end
  end
end
if after then redis.call('LINSERT', KEYS[1], 'BEFORE', after, p) else redis.call('RPUSH', KEYS[1], p) end
redis.call('HSET', KEYS[2], 'm:' .. p, ARGV[2], 's:' .. p, 'parked', 'd:' .. p, now_ms + tonumber(ARGV[6]),
           't:' .. p, ARGV[3], 'n:' .. p, ARGV[4], 'g:' .. p, ARGV[5], 'o:' .. p, first)
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[7]) then redis.call('PEXPIRE', KEYS[i], ARGV[7]) end
end
if #KEYS > 3 then redis.call('HSET', KEYS[2], 'k:' .. p, 's') end
return {'parked', pttl}
"""
)

CHECK_PARKED = (
    """
-- CHECK_PARKED: a copy of a parked delivery (safety or woken) reads and moves its entry, before ACQUIRE.
-- KEYS[1] waiter queue {prefix}:v1:{K}:wait   KEYS[2] waiter entries {prefix}:v1:{K}:waiters
-- ARGV[1] park token P  ARGV[2] copy: 'woken' | 'safety'
-- ARGV[3] grace ms a 'waking' entry is left to its releaser (safety copy only)
-- Returns {state found ('parked'|'waking'|'woken'|'running'|'taken'|'missing'), ms since waking (or -1)}
-- Writes (see _decision.decide_parked for what each answer makes the copy do):
--   woken copy:  'waking'|'woken' -> 'running' (its safety copy then drops itself); 'taken' -> entry removed
--                (the safety copy ran it; this copy drops itself)
--   safety copy: 'parked' -> entry removed (it decides afresh); 'woken'|'running'|'taken' -> entry removed;
--                'waking' past the grace -> 'taken', and only that marker kept (a late woken copy then
--                drops itself and removes it); within it: nothing
"""
    + _NOW
    + """
local p = ARGV[1]
local function drop()
  redis.call('HDEL', KEYS[2], 's:' .. p, 'd:' .. p, 'm:' .. p, 't:' .. p, 'n:' .. p, 'g:' .. p, 'w:' .. p, 'o:' .. p,
             'k:' .. p)
end
local e = redis.call('HMGET', KEYS[2], 's:' .. p, 'w:' .. p)
local state = e[1] or 'missing'
local age = -1
if e[2] then age = now_ms - tonumber(e[2]) end
if ARGV[2] == 'woken' then
  if state == 'waking' or state == 'woken' then redis.call('HSET', KEYS[2], 's:' .. p, 'running') end
  if state == 'taken' then drop() end
  return {state, age}
end
if state == 'parked' then
  redis.call('LREM', KEYS[1], 1, p)
  drop()
elseif state == 'woken' or state == 'running' or state == 'taken' then
  drop()
elseif state == 'waking' and age >= tonumber(ARGV[3]) then
  drop()  -- the message and holder fields are not needed again: a marker of a few bytes stays
  redis.call('HSET', KEYS[2], 's:' .. p, 'taken')
end
return {state, age}
"""
)

CONFIRM_WAKE = """
-- CONFIRM_WAKE: the releaser published the woken copy: its entry 'waking' -> 'woken'.
-- KEYS[1] waiter entries {prefix}:v1:{K}:waiters
-- ARGV[1] park token P
-- Returns 1 confirmed; 0 the entry is no longer 'waking' (the woken copy already runs, or the safety
-- copy took over after the grace, or it is gone)
if redis.call('HGET', KEYS[1], 's:' .. ARGV[1]) ~= 'waking' then return 0 end
redis.call('HSET', KEYS[1], 's:' .. ARGV[1], 'woken')
return 1
"""

WORKFLOW_ENTER = (
    """
-- WORKFLOW_ENTER: a member of a workflow (celery_lockguard.workflow) enters the workflow's lease on its
-- N entities (N = 1, or lock_key as a sequence): the first member takes them when every one is free (all
-- or none: a held entity makes it take nothing); a later member takes them over from the member that
-- handed them on (state 'gap', field next = this member's slot). The workflow state lives on every
-- entity alike (entity 1, the anchor, is read; all are written). One round trip per member.
-- N = (#KEYS - 1) / 2 entities, sorted.
-- KEYS[1..N] lease hashes {prefix}:v1:{K_i}:lock   KEYS[N+1..2N] fence counters {prefix}:v1:{K_i}:fence
-- KEYS[2N+1] ended workflows of the anchor {prefix}:v1:{K_1}:wfended (sorted set of ids, WORKFLOW_END)
-- ARGV[1] workflow id  ARGV[2] member task id  ARGV[3] member task name
-- ARGV[4] token: the token of a fresh lease (a first member starting, or a take-over)
-- ARGV[5] ttl_ms  ARGV[6] workflow name  ARGV[7] workflow digest
-- ARGV[8] host  ARGV[9] pid  ARGV[10] worker nodename  ARGV[11] fence_ttl_ms
-- ARGV[12] '1' when this member is the workflow's first (it may start the workflow), else ''
-- ARGV[13] '1' to take over a 'running' entry of this very member (its earlier delivery died):
--          fresh token ARGV[4] and a new fence per entity, so a paused earlier delivery can neither
--          renew nor write past the fence; else ''
-- ARGV[14] this member's slot in the workflow ('#<index>', the same for its retries and redeliveries)
-- ARGV[15] a slot that admits this member too ('' none): a chord's callback enters when the lease waits
--          for (or still runs) its header's slot, since Celery runs it only after every header member
-- ARGV[16] '1' for a member running in parallel with others of its slot (a chord's header): it joins
--          the running lease (field par = its slot, active = members of the slot running) instead of
--          waiting for it; else ''
-- ARGV[16+i] (N > 1 only) 'siblings' of entity i: a JSON array of the workflow's other entity keys
-- Returns (N > 1: fences = {fence_1, ..., fence_N} appended where noted):
--   {'started', token, fence, 0[, fences]}        every entity was free; this first member took them
--   {'entered', token, fence, held_ms[, fences]}  handed to this member (or taken over by it); held_ms:
--                                        since the workflow took the lease (server time)
--   {'self', token, fence, held_ms, host, pid, ms_since_renewal, ttl[, fences]}  a delivery of this
--                                        member runs under the lease already (nothing written)
--   {'passed', state, task_id, next}     the workflow holds the lease but is at another member
--   {'held', task_id, task_name, digest, host, pid, state, pttl_ms, ms_since_renewal, token, ttl_ms}
--                                        (N = 1) another holder (as ACQUIRE answers; a first member also
--                                        meets the slot leases of a lock_limit task on K, as ACQUIRE does)
--   {'blocked', i, held}                 (N > 1) entity i is held by another holder (the first in order);
--                                        held as above; nothing written
--   {'lost'}                             no lease, and this member is not the first; or (N > 1) the
--                                        workflow no longer holds every one of its entities
--   {'ended'}                            the lease is not this workflow's, and the workflow ended
--                                        (KEYS[2N+1]): a stale copy of a member, nothing written
-- Errors (nothing written): 'LOCKGUARD_CORRUPT_FENCE <fence key> <value>' (see ACQUIRE), for any entity
"""
    + _NOW
    + _NEXT_FENCE
    + _HELD_SLOTS
    + """
local n = (#KEYS - 1) / 2
local cur = redis.call('HMGET', KEYS[1], 'token', 'task_id', 'task_name', 'digest', 'host', 'pid',
                       'state', 'renewed_at', 'fence', 'ttl', 'workflow', 'next', 'acquired_at', 'par')
local parallel = ARGV[16] == '1'
local function with_fences(reply, fences)
  if n > 1 then reply[#reply + 1] = fences end
  return reply
end
local function current_fences()
  local f = {cur[9]}
  for i = 2, n do f[i] = redis.call('HGET', KEYS[i], 'fence') end
  return f
end
-- fresh fences for every entity, or nil and the error reply (nothing written) for a corrupt counter
local function fresh_fences()
  local last = {}
  for i = 1, n do
    local bad, seen = corrupt_fence(KEYS[n + i])
    if bad then return nil, bad end
    last[i] = seen
  end
  local f = {}
  for i = 1, n do f[i] = next_fence(KEYS[n + i], ARGV[11], now_us, last[i]) end
  return f
end
local function enter(token, fences, joining)
  for i = 1, n do
    local key = KEYS[i]
    redis.call('HSET', key, 'token', token, 'task_id', ARGV[2], 'member', ARGV[3], 'host', ARGV[8],
               'pid', ARGV[9], 'worker', ARGV[10], 'state', 'running', 'renewed_at', now_ms, 'ttl', ARGV[5],
               'fence', fences[i], 'next', '')
    if parallel then
      if not joining then redis.call('HSET', key, 'active', 0) end
      redis.call('HSET', key, 'par', ARGV[14])
      redis.call('HINCRBY', key, 'active', 1)
    else  -- a chord's tallies (WORKFLOW_LEAVE) start afresh for the next chord
      redis.call('HSET', key, 'par', '', 'active', 0, 'left', 0, 'failed', '', 'hold', 0)
    end
    redis.call('HSET', key, 'waits_on', '')
    redis.call('PEXPIRE', key, ARGV[5])
  end
  return with_fences({'entered', token, fences[1], now_ms - (tonumber(cur[13]) or now_ms)}, fences)
end
if cur[1] and cur[11] == ARGV[1] then
  for i = 2, n do  -- the workflow holds all its entities or none: a part gone (forced, expired) is a loss
    if redis.call('HGET', KEYS[i], 'token') ~= cur[1] then return {'lost'} end
  end
  local admitted = cur[12] == ARGV[14] or (ARGV[15] ~= '' and cur[12] == ARGV[15])
  if cur[7] == 'gap' and admitted then return enter(cur[1], current_fences(), false) end
  if parallel and cur[7] == 'running' and cur[14] == ARGV[14] then return enter(cur[1], current_fences(), true) end
  -- a chord's callback runs only once every header member ended: it may enter past a member that died
  if ARGV[15] ~= '' and cur[7] == 'running' and cur[14] == ARGV[15] then
    return enter(cur[1], current_fences(), false)
  end
  if not parallel and cur[7] == 'running' and cur[2] == ARGV[2] then
    if ARGV[13] ~= '1' then
      return with_fences({'self', cur[1], cur[9], now_ms - (tonumber(cur[13]) or now_ms), cur[5] or '',
                          cur[6] or '', now_ms - (tonumber(cur[8]) or now_ms), tonumber(cur[10]) or 0},
                         current_fences())
    end
    local fences, bad = fresh_fences()
    if bad then return redis.error_reply(bad) end
    return enter(ARGV[4], fences, false)
  end
  return {'passed', cur[7] or '', cur[2] or '', cur[12] or ''}
end
if redis.call('ZSCORE', KEYS[2 * n + 1], ARGV[1]) then return {'ended'} end
local function blocked(i, reply)
  if n > 1 then return {'blocked', i, reply} end
  return reply
end
for i = 1, n do
  local h = cur
  if i > 1 then
    h = redis.call('HMGET', KEYS[i], 'token', 'task_id', 'task_name', 'digest', 'host', 'pid', 'state',
                   'renewed_at', 'fence', 'ttl')
  end
  if h[1] then
    return blocked(i, {'held', h[2] or '', h[3] or '', h[4] or '', h[5] or '', h[6] or '', h[7] or '',
                       redis.call('PTTL', KEYS[i]), now_ms - (tonumber(h[8]) or now_ms), h[1], tonumber(h[10]) or 0})
  end
  if i == 1 and ARGV[12] ~= '1' then return {'lost'} end
end
for i = 1, n do
  local slot, busy = held_slot(KEYS[i], KEYS[n + i])  -- the workflow lease is exclusive, as the single lease
  if slot then return blocked(i, held_slot_reply(KEYS[i], slot, busy, now_ms)) end
end
local fences, bad = fresh_fences()
if bad then return redis.error_reply(bad) end
local par, active = '', 0
if parallel then par, active = ARGV[14], 1 end
for i = 1, n do
  redis.call('HSET', KEYS[i], 'token', ARGV[4], 'task_id', ARGV[2], 'task_name', ARGV[6], 'digest', ARGV[7],
             'host', ARGV[8], 'pid', ARGV[9], 'worker', ARGV[10], 'state', 'running', 'acquired_at', now_ms,
             'renewed_at', now_ms, 'ttl', ARGV[5], 'fence', fences[i], 'workflow', ARGV[1], 'member', ARGV[3],
             'next', '', 'par', par, 'active', active)
  if n > 1 then redis.call('HSET', KEYS[i], 'siblings', ARGV[16 + i]) end
  redis.call('PEXPIRE', KEYS[i], ARGV[5])
end
return with_fences({'started', ARGV[4], fences[1], 0}, fences)
"""
)

WORKFLOW_PASS = """
-- WORKFLOW_PASS: a workflow member that ended hands the lease on to the member that runs next (the
-- chain's next step, or its own retry or wait copy): state 'gap', next = that member's slot, for the
-- gap TTL (the next member's renewer takes over when it enters). Token-checked on every entity: a
-- lease that is no longer ours (any entity of it) is left alone.
-- KEYS[1..N] lease hashes of the workflow's entities (N = 1, or lock_key as a sequence)
-- ARGV[1] token  ARGV[2] the next member's slot ('#<index>')
-- ARGV[3] gap ttl_ms (at least the delayed copy's countdown plus the publish grace)
-- ARGV[4] the entity the member waits for with its own lock ('' none): read by a member of another
--         workflow to tell a lock-order deadlock (cleared when the member enters again)
-- Returns 1 handed on; 0 the token is gone from an entity (the workflow lost its lease; nothing written)
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') ~= ARGV[1] then return 0 end
end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'state', 'gap', 'next', ARGV[2], 'waits_on', ARGV[4] or '')
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return 1
"""

WORKFLOW_LEAVE = (
    """
-- WORKFLOW_LEAVE: a member running in parallel with others of its slot (a chord's header) ended (well
-- or not), or retries: one fewer running; the last one to leave hands the lease on to the slot itself
-- (a retry or a member still queued enters it, and so does the chord's callback) for the longest gap
-- any member of the slot asked for (a retry's countdown plus the publish grace outlives a short gap).
-- Once every member of the slot ended for good and one of them failed, the chord's callback never
-- comes (Celery fails it): the last one out is told to end the workflow.
-- KEYS[1..N] lease hashes of the workflow's entities (N = 1, or lock_key as a sequence): the tallies
--          are counted on KEYS[1] (the anchor) and copied, with the state and TTL, to the others
-- ARGV[1] token  ARGV[2] the member's slot ('#<index>')  ARGV[3] gap ttl_ms
-- ARGV[4] '1' the member ended for good (not a retry)  ARGV[5] '1' it failed
-- ARGV[6] members in the slot (0: not known)
-- ARGV[7] '1' the member already left for a retry that was never published (its retries ran out): it is
--         not counted out of the running again, only as ended
-- Returns the members of the slot still running (>= 0); -1 the token is gone from an entity (nothing
--   written); -2 the slot is done and one of its members failed: the caller ends the workflow
"""
    + _NOW
    + """
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') ~= ARGV[1] then return -1 end
end
local function mirror(result)  -- every entity carries the anchor's workflow state and TTL
  if #KEYS > 1 then
    local f = redis.call('HMGET', KEYS[1], 'active', 'left', 'failed', 'hold', 'state', 'next')
    local pttl = redis.call('PTTL', KEYS[1])
    for i = 2, #KEYS do
      redis.call('HSET', KEYS[i], 'active', f[1] or 0, 'left', f[2] or 0, 'failed', f[3] or '',
                 'hold', f[4] or 0, 'state', f[5] or '', 'next', f[6] or '')
      if pttl > 0 then redis.call('PEXPIRE', KEYS[i], pttl) end
    end
  end
  return result
end
local active
if ARGV[7] == '1' then
  active = tonumber(redis.call('HGET', KEYS[1], 'active')) or 0
else
  active = redis.call('HINCRBY', KEYS[1], 'active', -1)
end
local left = tonumber(redis.call('HGET', KEYS[1], 'left')) or 0
if ARGV[4] == '1' then left = redis.call('HINCRBY', KEYS[1], 'left', 1) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'failed', '1') end
local hold = math.max(now_ms + tonumber(ARGV[3]), tonumber(redis.call('HGET', KEYS[1], 'hold')) or 0)
redis.call('HSET', KEYS[1], 'hold', hold)
if active <= 0 then
  local width = tonumber(ARGV[6]) or 0
  if redis.call('HGET', KEYS[1], 'failed') == '1' and (width == 0 or left >= width) then return mirror(-2) end
  redis.call('HSET', KEYS[1], 'state', 'gap', 'next', ARGV[2], 'active', 0)
  redis.call('PEXPIRE', KEYS[1], math.max(1, hold - now_ms))
  return mirror(0)
end
return mirror(active)
"""
)

WORKFLOW_WAITS_ON = """
-- WORKFLOW_WAITS_ON: a workflow member about to wait for its own lock on another entity says so in the
-- workflow's lease (before it looks for a lock-order cycle), so a member of another workflow that
-- waits for any of this workflow's entities finds the cycle even when both look at the same moment.
-- KEYS[1..N] lease hashes of the workflow's entities (N = 1, or lock_key as a sequence)
-- ARGV[1] token  ARGV[2] the entity the member waits for
-- Returns 1 recorded on every entity; 0 the token is gone from an entity (nothing written)
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') ~= ARGV[1] then return 0 end
end
for i = 1, #KEYS do redis.call('HSET', KEYS[i], 'waits_on', ARGV[2]) end
return 1
"""

WORKFLOW_END = (
    """
-- WORKFLOW_END: a workflow ended (its last member released, a member failed, a member was revoked):
-- remember its id for a while, so that a redelivered copy of one of its members (a broker
-- redelivery after a lost ack) is dropped by WORKFLOW_ENTER instead of starting the workflow again.
-- Called before the lease is released, so no copy can find the lease free and the id unknown.
-- A workflow over several entities records it on its anchor (the first entity), where ENTER looks.
-- KEYS[1] ended workflows {prefix}:v1:{K}:wfended (sorted set: workflow id -> end time, ms)
-- ARGV[1] workflow id  ARGV[2] window_ms: how long ids are remembered (older ones are trimmed)
-- Returns 1
"""
    + _NOW
    + """
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

WORKFLOW_ABORT = """
-- WORKFLOW_ABORT: from the worker's main process, which has no token: end the workflow lease a
-- member of workflow W holds or is waiting for, when that member will not go on (revoked while
-- queued, terminated while running). Decided on the first entity still W's (the anchor, unless it was
-- released by force or expired); done to every entity still W's.
-- KEYS[1..N] lease hashes of the workflow's entities (N = 1, or lock_key as a sequence)
-- ARGV[1] workflow id  ARGV[2] member task id
-- ARGV[3] grace_ms for a running member (its child may not be dead yet: cut to the grace, never
--         lengthened); a member the lease waits for in the gap (next = ARGV[4]) frees it at once
-- ARGV[4] the member's slot ('#<index>')
-- Returns 1 shortened or freed; 0 the lease is not W's at that member (nothing written)
local cur = {}
for i = 1, #KEYS do  -- decided on the first entity still W's: one may be gone (forced, expired)
  cur = redis.call('HMGET', KEYS[i], 'workflow', 'state', 'task_id', 'next')
  if cur[1] == ARGV[1] then break end
end
if cur[1] ~= ARGV[1] then return 0 end
local free = cur[2] == 'gap' and cur[4] == ARGV[4]
if not free and not (cur[2] == 'running' and cur[3] == ARGV[2]) then return 0 end
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'workflow') == ARGV[1] then
    if free then
      redis.call('DEL', KEYS[i])
    else
      local pttl = redis.call('PTTL', KEYS[i])
      if pttl < 0 or pttl > tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
    end
  end
end
return 1
"""

WORKFLOW_FORFEIT = """
-- WORKFLOW_FORFEIT: a workflow over several entities found one of them gone (a forced release, an
-- expiry). Its other scripts then write nothing (all or none), so the entities still W's would stay held
-- until gap_ttl or lock_ttl, their waiters with them. This frees none itself: it names those to release
-- (by RELEASE, which wakes each entity's oldest waiter), once nothing of W runs under them any more.
-- KEYS[1..N] lease hashes of the workflow's entities
-- ARGV[1] workflow id W
-- ARGV[2] who asks: 'enter' (a member that found the loss on entering: only entities in the gap go,
--         a running member ends them itself), 'pass' (the running member ending: all go), 'leave' (a
--         chord page ending: one page fewer runs (field active); all go with the last)
-- ARGV[3] 'pass'/'leave': the caller's lease token; only entities under it are W's to it (a delivery taken
--         over has a fresh token, which is not the stale one's to free). 'enter': '' (no token yet)
-- ARGV[4] 'leave': '1' when this page was counted out already (its retries ran out after it left): not again
-- Returns a flat {i, token, ...}: the entities still W's to release now ({}: none, or pages still run)
local mine = {}
for i = 1, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'workflow', 'token', 'state', 'active')
  if f[1] == ARGV[1] and f[2] and (ARGV[2] == 'enter' or f[2] == ARGV[3]) then
    if ARGV[2] ~= 'enter' or f[3] == 'gap' then mine[#mine + 1] = {i, f[2], tonumber(f[4]) or 0} end
  end
end
if ARGV[2] == 'leave' and #mine > 0 then
  local running = mine[1][3]
  if ARGV[4] ~= '1' then
    for _, m in ipairs(mine) do running = redis.call('HINCRBY', KEYS[m[1]], 'active', -1) end
  end
  if running > 0 then return {} end
end
local out = {}
for _, m in ipairs(mine) do out[#out + 1] = m[1]; out[#out + 1] = m[2] end
return out
"""


# -- debounce (``lock_debounce``; see celery_lockguard._debounce) ------------------------------------

DEBOUNCE_PUBLISH = (
    """
-- DEBOUNCE_PUBLISH: record a publish of debounced work as the entity's latest pending run (last wins).
-- KEYS[1] debounce record  {prefix}:v1:{K}:debounce:<task name>   (hash)
-- ARGV[1] task_id  ARGV[2] args digest  ARGV[3] delay_ms (the message's countdown)
-- ARGV[4] ttl_ms (delay + visibility_timeout + queue_lock_ttl: as long as any message of the burst, or a
--         dead worker's redelivered copy of one, may still arrive)
-- The record becomes {task_id, digest, due_ms = now + delay, state 'publishing', at_ms = now, burst};
-- the run it replaces (if one was pending) is kept as prev_* so a failed publish can put it back
-- (DEBOUNCE_SETTLE). The record's TTL is extended, never shortened.
-- Returns {burst, replaced_task_id}
--   burst: the burst this message belongs to (the first pending message's task id; a publish with
--          nothing pending starts a new burst named after itself)
--   replaced_task_id: the pending run this publish supersedes ('' when none was pending)
"""
    + _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'state', 'due_ms', 'digest', 'burst')
local burst, replaced = ARGV[1], ''
if cur[1] and cur[1] ~= '' and cur[1] ~= ARGV[1] then
  burst, replaced = cur[5] or ARGV[1], cur[1]
  redis.call('HSET', KEYS[1], 'prev_id', cur[1], 'prev_state', cur[2] or 'queued', 'prev_due', cur[3] or '0',
             'prev_digest', cur[4] or '')
  redis.call('HINCRBY', KEYS[1], 'superseded', 1)
elseif cur[1] == ARGV[1] then
  burst = cur[5] or ARGV[1]
else
  redis.call('HDEL', KEYS[1], 'prev_id', 'prev_state', 'prev_due', 'prev_digest')
  redis.call('HSET', KEYS[1], 'superseded', 0)
end
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'digest', ARGV[2], 'due_ms', now_ms + tonumber(ARGV[3]),
           'state', 'publishing', 'at_ms', now_ms, 'burst', burst)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
return {burst, replaced}
"""
)

DEBOUNCE_SETTLE = """
-- DEBOUNCE_SETTLE: the publisher of a debounced message says how its publish ended.
-- KEYS[1] debounce record  {prefix}:v1:{K}:debounce:<task name>
-- ARGV[1] task_id  ARGV[2] 'published' | 'failed'
-- published: a 'publishing' record of this task id becomes 'queued' (the runs it replaced may now
--            consume themselves as superseded); as prev_* it is marked queued too
-- failed:    the record of this task id puts back the run it replaced (prev_*), or clears the pending
--            run when it replaced none; a later publish that replaced this one forgets it as prev_*
--            (its own failure then clears, and the burst's older messages run: never lost)
-- Returns 1 written; 0 the record does not name this task id (taken, replaced, expired: nothing written)
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'state', 'prev_id', 'prev_state', 'prev_due', 'prev_digest')
if ARGV[2] == 'published' then
  if cur[1] == ARGV[1] then
    if cur[2] == 'publishing' then redis.call('HSET', KEYS[1], 'state', 'queued') end
    return 1
  end
  if cur[3] == ARGV[1] then
    redis.call('HSET', KEYS[1], 'prev_state', 'queued')
    return 1
  end
  return 0
end
if cur[1] == ARGV[1] then
  if cur[3] and cur[3] ~= '' then
    redis.call('HSET', KEYS[1], 'task_id', cur[3], 'state', cur[4] or 'queued', 'due_ms', cur[5] or '0',
               'digest', cur[6] or '')
    redis.call('HINCRBY', KEYS[1], 'superseded', -1)
  else
    redis.call('HSET', KEYS[1], 'task_id', '', 'state', '')
  end
  redis.call('HDEL', KEYS[1], 'prev_id', 'prev_state', 'prev_due', 'prev_digest')
  return 1
end
if cur[3] == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'prev_id', 'prev_state', 'prev_due', 'prev_digest')
  return 1
end
return 0
"""

DEBOUNCE_TAKE = (
    """
-- DEBOUNCE_TAKE: a delivered debounced message asks whether it is its burst's run. One round trip.
-- KEYS[1] debounce record     {prefix}:v1:{K}:debounce:<task name>
-- KEYS[2] the burst's run     {prefix}:v1:{K}:debounce:<task name>:run:<burst>   (string: a task id)
-- ARGV[1] task_id  ARGV[2] burst (message header)  ARGV[3] grace_ms (a publish still 'publishing' that
--         long is taken as published)  ARGV[4] ttl_ms of the run key
-- Returns
--   {'take', ''}           this message is the burst's pending run and it is due: it becomes the burst's
--                          run (KEYS[2] = task_id, PX ARGV[4]); the record no longer names a pending run,
--                          so a publish from now on starts a new burst (one more run, after this one)
--   {'taken', ''}          KEYS[2] already names this task id: a redelivery or wait copy of the burst's run
--   {'early', ms}          this message is the pending run, due in ms (redelivered early, clock skew)
--   {'superseded', id}     a later publish replaced it; id is the burst's run (pending or taken)
--   {'await', id}          the publish that replaced it is still in flight (state 'publishing', younger
--                          than the grace): ask again shortly, it may fail and put this message back
--   {'missing', ''}        neither the record of its burst nor its run exists (expired, evicted, lost in a
--                          restart): the message runs, so no run is ever lost
"""
    + _NOW
    + """
local run = redis.call('GET', KEYS[2])
if run == ARGV[1] then return {'taken', ''} end
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'due_ms', 'state', 'at_ms', 'burst')
if cur[5] == ARGV[2] and cur[1] and cur[1] ~= '' then
  if cur[1] == ARGV[1] then
    local due = tonumber(cur[2]) or 0
    if now_ms < due then return {'early', tostring(due - now_ms)} end
    redis.call('HSET', KEYS[1], 'task_id', '', 'state', 'taken', 'last_run', ARGV[1], 'last_run_at', now_ms)
    redis.call('HDEL', KEYS[1], 'prev_id', 'prev_state', 'prev_due', 'prev_digest')
    redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
    if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
    return {'take', ''}
  end
  if cur[3] == 'publishing' and now_ms - (tonumber(cur[4]) or 0) < tonumber(ARGV[3]) then
    return {'await', cur[1]}
  end
  return {'superseded', cur[1]}
end
if run then return {'superseded', run} end
return {'missing', ''}
"""
)


DEBOUNCE_KEEP = """
-- DEBOUNCE_KEEP: a burst's run is retried (retry() keeps its burst): keep the burst's keys at least as long as
-- the retry may take to come back, so DEBOUNCE_START can still tell whether a later run started since.
-- KEYS[1] debounce record  {prefix}:v1:{K}:debounce:<task name>
-- KEYS[2] the burst's run  {prefix}:v1:{K}:debounce:<task name>:run:<burst>
-- ARGV[1] task_id (the retried run)  ARGV[2] ttl_ms (the retry's delay + visibility_timeout + queue_lock_ttl)
-- Both TTLs are extended to ARGV[2], never shortened.
-- Returns 1 kept; 0 the run key does not name this task id (expired, or not this burst's run: nothing written)
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local ttl = tonumber(ARGV[2])
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
local rec = redis.call('PTTL', KEYS[1])
if rec ~= -2 and rec < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
"""


DEBOUNCE_START = (
    """
-- DEBOUNCE_START: a burst's run holds the lease and is about to start its body: is it still the latest?
-- A taken run may wait for the lease (a body of the entity still running); until its body starts it is
-- still pending work, so a publish since it was taken replaces it (last publish wins), and so does a
-- later burst's run taken meanwhile (it carries newer arguments).
-- KEYS[1] debounce record  {prefix}:v1:{K}:debounce:<task name>
-- KEYS[2] the burst's run  {prefix}:v1:{K}:debounce:<task name>:run:<burst>   (the message's header)
-- ARGV[1] task_id  ARGV[2] grace_ms (a publish still 'publishing' that long is taken as published)
-- Returns
--   {'run', ''}          start the body; the record marks it started. Also when this message is not its
--                        burst's taken run (ran without its record, fail_open) or the record is gone
--   {'superseded', id}   a publish since this run was taken is pending, or a later burst's run was taken:
--                        id replaces it (release, do not run)
--   {'await', id}        that publish is still in flight (it may fail and leave nothing pending): ask again
"""
    + _NOW
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'run', ''} end
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'state', 'at_ms', 'last_run', 'started')
if not cur[4] or cur[5] == ARGV[1] then return {'run', ''} end
if cur[1] and cur[1] ~= '' and cur[1] ~= ARGV[1] then
  if cur[2] == 'publishing' and now_ms - (tonumber(cur[3]) or 0) < tonumber(ARGV[2]) then
    return {'await', cur[1]}
  end
  return {'superseded', cur[1]}
end
if cur[4] ~= ARGV[1] then return {'superseded', cur[4]} end
redis.call('HSET', KEYS[1], 'started', ARGV[1])
return {'run', ''}
"""
)


class Script:
    """A named Lua script run by raw EVALSHA, reloaded on NOSCRIPT.

    Raw EVALSHA rather than redis-py's ``Script`` inside a pipeline: pipelines
    send ``SCRIPT EXISTS`` first, doubling the round trips.
    """

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.sha_bytes = self.sha.encode()

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA; on NOSCRIPT, SCRIPT LOAD and retry once.

        A second NOSCRIPT means the server does not keep what was just loaded
        (a proxy spreading calls over nodes, a flush racing every load): it is
        raised as ``NoScriptError``, which :func:`celery_lockguard._errors.classify`
        reports as misconfigured, rather than retried forever.

        A plain client's calls go through this thread's :class:`~celery_lockguard._wire.Channel`
        (packed here, same reload rule); Sentinel and Cluster clients through redis-py.
        """
        ch = _wire.channel(client)
        if ch is not None:
            return ch.call(self, keys, args)
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError as exc:
            # The message starts with the code: redis-py < 6 keeps no ``status_code`` on its errors.
            raise NoScriptError(f"NOSCRIPT {self.name}: again right after SCRIPT LOAD ({exc})") from exc

    def __repr__(self) -> str:
        return f"<Script {self.name} {self.sha[:8]}>"


def corrupt_fence(exc: BaseException, fence_key: str | None = None) -> CorruptFence | None:
    """The :class:`CorruptFence` a script's ``LOCKGUARD_CORRUPT_FENCE`` error reply stands for, else ``None``.

    ``fence_key`` (the KEYS[2] the script was called with) splits key from value exactly.
    """
    if not isinstance(exc, ResponseError):
        return None
    text = str(exc)
    if not text.startswith(CORRUPT_FENCE + " "):
        return None
    rest = text[len(CORRUPT_FENCE) + 1 :]
    if fence_key is not None and rest.startswith(fence_key + " "):
        return CorruptFence(fence_key, rest[len(fence_key) + 1 :])
    key, sep, value = rest.partition(":fence ")  # keys.fence_name ends with ":fence"
    return CorruptFence(key + ":fence", value) if sep else CorruptFence(rest, "")


acquire = Script("ACQUIRE", ACQUIRE)
acquire_slots = Script("ACQUIRE_SLOTS", ACQUIRE_SLOTS)
acquire_multi = Script("ACQUIRE_MULTI", ACQUIRE_MULTI)
release_multi = Script("RELEASE_MULTI", RELEASE_MULTI)
keep_before = Script("KEEP_BEFORE", KEEP_BEFORE)
release = Script("RELEASE", RELEASE)
renew = Script("RENEW", RENEW)
shorten = Script("SHORTEN", SHORTEN)
force_release = Script("FORCE_RELEASE", FORCE_RELEASE)
wake = Script("WAKE", WAKE)
claim = Script("CLAIM", CLAIM)
release_claim = Script("RELEASE_CLAIM", RELEASE_CLAIM)
handover = Script("HANDOVER", HANDOVER)
confirm_claim = Script("CONFIRM_CLAIM", CONFIRM_CLAIM)
watch_arm = Script("WATCH_ARM", WATCH_ARM)
park = Script("PARK", PARK)
check_parked = Script("CHECK_PARKED", CHECK_PARKED)
confirm_wake = Script("CONFIRM_WAKE", CONFIRM_WAKE)
debounce_publish = Script("DEBOUNCE_PUBLISH", DEBOUNCE_PUBLISH)
debounce_settle = Script("DEBOUNCE_SETTLE", DEBOUNCE_SETTLE)
debounce_take = Script("DEBOUNCE_TAKE", DEBOUNCE_TAKE)
debounce_start = Script("DEBOUNCE_START", DEBOUNCE_START)
debounce_keep = Script("DEBOUNCE_KEEP", DEBOUNCE_KEEP)
workflow_enter = Script("WORKFLOW_ENTER", WORKFLOW_ENTER)
workflow_pass = Script("WORKFLOW_PASS", WORKFLOW_PASS)
workflow_leave = Script("WORKFLOW_LEAVE", WORKFLOW_LEAVE)
workflow_waits_on = Script("WORKFLOW_WAITS_ON", WORKFLOW_WAITS_ON)
workflow_end = Script("WORKFLOW_END", WORKFLOW_END)
workflow_abort = Script("WORKFLOW_ABORT", WORKFLOW_ABORT)
workflow_forfeit = Script("WORKFLOW_FORFEIT", WORKFLOW_FORFEIT)
