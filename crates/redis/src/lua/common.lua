-- Tollgate ledger, shared by every script (prepended to each). Integer arithmetic only; every
-- ledger function mirrors crates/core/src/ledger.rs. Numbers stay below 2^53 by the policy's
-- bounds. Admission and settlement are functions so that one call can carry many of them.
-- The ticket is one msgpack string under P:ts:<request>, which becomes the request's finished
-- marker when it ends (one SET ... GET at settlement). The scripts know a plan's checks by
-- their kinds (count, lease, reserve, verdict), never by their controls: a refusal names its
-- check by its place in the plan. The reply kinds are
-- those of ADMIT_REPLIES, SHADOW_REPLIES and FINISH_REPLIES (a test reads this file and checks
-- them).
-- v5: reservations of tool calls (unit 'c'), a settlement's tool calls, and the request's
-- repeats. v6: an admission with its shadow plan (admit_shadowed), whose reservations the
-- request's ticket holds with their units in capitals. v7: slices (slices.lua), whose
-- tickets the sweep expires too.

-- Redis loads these files once, as one library (crates/redis/build.rs): every function is made
-- then, and each entry point (batch, renew, usage, sweep, state, keys) starts its call with
-- enter, which sets what belongs to the call. Constants written as literals: 10000, the sliding
-- window's fixed-point weight scale; 2147483648 (2^31), the cap of a window's count; 86400000,
-- a day in ms.
--
-- The call's key prefix, its first argument.
local PREFIX = nil
-- The schema of what these scripts keep, written as the marker's value: an instance of another
-- schema refuses to start on the prefix. The build writes it from `SCHEMA` in contract.rs.
local SCHEMA = '@schema'

-- Numeric strings become numbers by arithmetic (`0 + s`, `s * 1000`), not by tonumber: Redis's
-- Lua 5.1 tonumber runs strtod twice (lua_isnumber, then lua_tonumber), where arithmetic runs
-- it once.
--
-- A policy number from its ARGV string.
local function num(s)
  return s and 0 + s
end

-- A number handed to redis.call or joined to a string would be formatted with '%.14g'
-- (glibc's floating-point printf); integers go as strings formatted with '%d' instead, or as
-- the ARGV string they came in.
local function int(n)
  return string.format('%d', n)
end

-- Write-back state of the scope keys a call touches. A batch call's items often share their
-- scopes (a global, tenant or key scope is in every request), and every redis.call is costly
-- inside Redis (arguments made into objects, the command looked up, the reply written as RESP
-- and parsed back into Lua). So a call reads each rate window, lease count and budget cell once,
-- applies its items to them in order, and writes each key once at the end (flush). Items still
-- see exactly what they would have seen one call each: every read of a key in the call goes
-- through this state, and a step that reads or writes a key directly (a period rollover, an
-- old period's settlement, a full lease set, an undo) writes the key's pending changes first.
--
-- Each entry is one flat table (a table costs an allocation or three inside Redis's Lua, and a
-- call whose items share no scope pays for its entries without a saving):
-- RATE[key] = {start, count, previous, window (string, false when none), then the start (-1
--   when none), count and window as read}
-- LEASE[key] = {held (false: not read; never below the truth), keep (ms, the longest asked, or
--   false), members to remove (a table, or false), n, then n values to add: score, member, ...}
--   (made with room for one lease, so that a key used once needs no second allocation)
-- BUDGET[key] = {field, settled, reserved (false until read; then read + pending), pending
--   settled, pending reserved, 'cur' (false until read; '' when absent), the pending reserved
--   change as the string it came in when it is one item's (else false: formatted at the end),
--   what the period carries over from the one before (read with the rest)}: the current
--   period's cell (an item only ever reserves in the period containing now).
-- XADD, XREM: pending changes of the expiry index.
local RATE, LEASE, BUDGET, XADD, XREM = {}, {}, {}, {}, {}

-- A sorted set of up to 128 members is a listpack, where ZADD and ZREM walk every member (a
-- skiplist finds its place in O(log n)). The expiry index holds every request in flight, and a lease set every lease of its scope, so they are
-- big exactly when the load is. The skiplist member, scored +inf and longer than
-- zset-max-listpack-value (64 bytes by default), makes Redis keep a set as a skiplist for good
-- (O(log n)). It goes into the index with every change, and into a lease set once 16 leases are
-- held in it. Counts leave it out (ZCOUNT -inf (+inf, O(log n) on a skiplist); a request id
-- equal to it would only cost speed.

local function lease_flush(key, l)
  if l[4] > 0 then
    if l[1] and l[1] >= 16 then
      redis.call('ZADD', key, '+inf',
        '~ tollgate: a sorted set holding this member stays a skiplist (docs/redis.md) ~',
        unpack(l, 5, 4 + l[4]))
    else
      redis.call('ZADD', key, unpack(l, 5, 4 + l[4]))
    end
    l[4] = 0
  end
  if l[2] then
    redis.call('PEXPIRE', key, int(l[2]))
    l[2] = false
  end
  if l[3] then
    redis.call('ZREM', key, unpack(l[3]))
    l[3] = false
  end
end

-- The entry of a lease set; with `read`, its count known.
local function lease(key, read)
  local l = LEASE[key]
  if l == nil then
    l = {false, false, false, 0, false, false}
    LEASE[key] = l
  end
  if read and l[1] == false then
    lease_flush(key, l)
    l[1] = redis.call('ZCOUNT', key, '-inf', '(+inf')
  end
  return l
end

local function budget_flush(key, b)
  if b[4] ~= 0 then
    redis.call('HINCRBY', key, b[1] .. ':s', int(b[4]))
    b[4] = 0
  end
  if b[5] ~= 0 then
    redis.call('HINCRBY', key, b[1] .. ':r', b[7] or int(b[5]))
    b[5], b[7] = 0, false
  end
end

-- The entry of a budget key's current cell; with `read`, its amounts and 'cur' known.
local function budget(key, field, read)
  local b = BUDGET[key]
  if b == nil or b[1] ~= field then
    if b ~= nil then budget_flush(key, b) end
    b = {field, false, false, 0, 0, false, false, 0}
    BUDGET[key] = b
  end
  if read and (b[2] == false or b[6] == false) then
    local h = redis.call('HMGET', key, field .. ':s', field .. ':r', 'cur', field .. ':c')
    b[2] = (h[1] or 0) + b[4]
    b[3] = (h[2] or 0) + b[5]
    b[6] = h[3] or ''
    b[8] = 0 + (h[4] or 0)
  end
  return b
end

-- Writes every pending change of the call: rate windows, leases, budget cells, expiry index.
-- With `forget`, also forgets what was read (before a step that touches keys directly).
local function flush(forget)
  for key, r in pairs(RATE) do
    if r[4] ~= r[7] or r[1] ~= r[5] then
      redis.call('HSET', key, 's', int(r[1]), 'c', int(r[2]), 'p', int(r[3]), 'w', r[4])
    elseif r[2] ~= r[6] then
      local d = r[2] - r[6]
      redis.call('HINCRBY', key, 'c', d == 1 and '1' or int(d))
    end
    -- Set when a window starts: it then covers this window and the next, as long as it matters.
    if r[1] ~= r[5] then redis.call('PEXPIRE', key, int(2 * num(r[4]) + 1000)) end
    r[5], r[6], r[7] = r[1], r[2], r[4]
  end
  for key, l in pairs(LEASE) do lease_flush(key, l) end
  for key, b in pairs(BUDGET) do budget_flush(key, b) end
  if #XADD > 0 then
    redis.call('ZADD', PREFIX .. ':x', '+inf',
      '~ tollgate: a sorted set holding this member stays a skiplist (docs/redis.md) ~',
      unpack(XADD))
    XADD = {}
  end
  if #XREM > 0 then
    redis.call('ZREM', PREFIX .. ':x', unpack(XREM))
    XREM = {}
  end
  if forget then RATE, LEASE, BUDGET = {}, {}, {} end
end

-- The store's time of this call as a string (set by store_now), and its clock's before it was
-- kept from going back (a slice's instance estimates the store's time from it).
local NOW_STR, CLOCK_NOW = nil, nil

-- The store's time: the caller's (tests drive a manual clock) or Redis TIME, never earlier than
-- any time this store has used before. Returns it as a number and as the string that Redis
-- commands take.
local function store_now(override)
  local now
  if override == nil or override == '0' then
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  else
    now = 0 + override
  end
  CLOCK_NOW = now
  local key = PREFIX .. ':clock'
  local now_str = int(now)
  -- One round inside Redis: write now and read what was there; put it back if it was later.
  -- Both are '%d' strings, so the longer one, or at equal length the greater, is later (no
  -- strtod on every call).
  local last = redis.call('SET', key, now_str, 'PX', '2592000000', 'GET')
  if last and (#last > #now_str or (#last == #now_str and last > now_str)) then
    now, now_str = 0 + last, last
    redis.call('SET', key, now_str, 'PX', '2592000000')
  end
  NOW_STR = now_str
  return now, now_str
end

-- The start of every entry point's call: the prefix, and nothing left of an earlier call.
local function enter(args)
  PREFIX = args[1]
  RATE, LEASE, BUDGET, XADD, XREM = {}, {}, {}, {}, {}
  NOW_STR, CLOCK_NOW = nil, nil
end
