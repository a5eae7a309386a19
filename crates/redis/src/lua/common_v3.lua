-- Tollgate ledger, shared by every script (prepended to each). Integer arithmetic only; every
-- ledger function mirrors crates/core/src/ledger.rs. Numbers stay below 2^53 by the policy's
-- bounds. Admission and settlement are functions so that one call can carry many of them.
-- v3: the ticket is one msgpack string under P:ts:<request>, which becomes the request's
-- finished marker when it ends (one SET ... GET at settlement; v2 read a list, deleted it and
-- created a separate marker key).

local WEIGHT_SCALE = 10000
local COUNT_CAP = 2147483648
local DAY_MS = 86400000
local PREFIX = ARGV[1]

local function floor_div(a, b) return math.floor(a / b) end

-- Conversions of one call, remembered for the rest of it: a batch's items repeat the same
-- limits, windows, lengths and TTLs, and a conversion (strtod, printf) costs about ten times a
-- table lookup. MEMO maps strings to numbers and numbers to strings, PERIODS a period length to
-- the period containing now. A call's first item converts without them and the second makes
-- them: when no item follows (a single caller's call holds one), filling tables costs more than
-- it saves. ITEMS counts the items begun (the script runs from the top on every call).
local MEMO, PERIODS, ITEMS = nil, nil, 0

-- A policy number from its ARGV string (tonumber is strtod: about 1,900 instructions).
local function num(s)
  if ITEMS < 2 then return tonumber(s) end
  local n = MEMO[s]
  if n == nil and s ~= nil then
    n = tonumber(s)
    MEMO[s] = n
  end
  return n
end

-- A number handed to redis.call or joined to a string is formatted with '%.14g' (glibc's
-- floating-point printf: about 0.4 to 0.7 µs each on a 2-core machine). Integers go as strings
-- instead: formatted once with '%d' (about 0.3 µs), or passed on as the ARGV string they came in.
local function int(n)
  if ITEMS < 2 then return string.format('%d', n) end
  local s = MEMO[n]
  if s == nil then
    s = string.format('%d', n)
    MEMO[n] = s
  end
  return s
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
--   change as the string it came in when it is one item's (else false: formatted at the end)}:
--   the current period's cell (an item only ever reserves in the period containing now).
-- XADD, XREM: pending changes of the expiry index.
local RATE, LEASE, BUDGET, XADD, XREM = {}, {}, {}, {}, {}

-- A sorted set of up to 128 members is a listpack, where ZADD and ZREM walk every member: a
-- ZADD and a ZREM at 64 members cost about 45,700 instructions, 20,400 on a skiplist. The expiry
-- index holds every request in flight, and a lease set every lease of its scope, so they are
-- big exactly when the load is. The skiplist member, scored +inf and longer than
-- zset-max-listpack-value (64 bytes by default), makes Redis keep a set as a skiplist for good
-- (O(log n)). It goes into the index with every change, and into a lease set once 16 leases are
-- held in it. Counts leave it out (ZCOUNT -inf (+inf, O(log n) on a skiplist); a request id
-- equal to it would only cost speed. It is written out where it is used: a literal costs
-- nothing per call, while a shared local is captured by every function that uses it.

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
    b = {field, false, false, 0, 0, false, false}
    BUDGET[key] = b
  end
  if read and (b[2] == false or b[6] == false) then
    local h = redis.call('HMGET', key, field .. ':s', field .. ':r', 'cur')
    b[2] = tonumber(h[1] or '0') + b[4]
    b[3] = tonumber(h[2] or '0') + b[5]
    b[6] = h[3] or ''
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

-- The store's time of this call as a string (set by store_now).
local NOW_STR = nil

-- The store's time: the caller's (tests drive a manual clock) or Redis TIME, never earlier than
-- any time this store has used before. Returns it as a number and as the string that Redis
-- commands take.
local function store_now(override)
  local now
  if override == nil or override == '0' then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + floor_div(tonumber(t[2]), 1000)
  else
    now = tonumber(override)
  end
  local key = PREFIX .. ':clock'
  local now_str = int(now)
  -- One round inside Redis: write now and read what was there; put it back if it was later.
  -- Both are '%d' strings, so the longer one, or at equal length the greater, is later (no
  -- strtod on every call).
  local last = redis.call('SET', key, now_str, 'PX', '2592000000', 'GET')
  if last and (#last > #now_str or (#last == #now_str and last > now_str)) then
    now, now_str = tonumber(last), last
    redis.call('SET', key, now_str, 'PX', '2592000000')
  end
  NOW_STR = now_str
  return now, now_str
end

local function civil_from_days(days)
  local z = days + 719468
  local era = floor_div(z, 146097)
  local doe = z - era * 146097
  local yoe = floor_div(doe - floor_div(doe, 1460) + floor_div(doe, 36524) - floor_div(doe, 146096), 365)
  local doy = doe - (365 * yoe + floor_div(yoe, 4) - floor_div(yoe, 100))
  local mp = floor_div(5 * doy + 2, 153)
  local d = doy - floor_div(153 * mp + 2, 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor_div(y, 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = floor_div(153 * mp + 2, 5) + d - 1
  local doe = yoe * 365 + floor_div(yoe, 4) - floor_div(yoe, 100) + doy
  return era * 146097 + doe - 719468
end

-- (id, start, end) of the period containing now; len 0 means calendar month. Remembered per
-- length for the rest of the call (see MEMO).
local function period_at(len, now)
  local p = ITEMS > 1 and PERIODS[len]
  if p and p[1] == now then return p[2], p[3], p[4] end
  local id, start, stop
  if len > 0 then
    id = floor_div(now, len)
    start, stop = id * len, (id + 1) * len
  else
    local y, m = civil_from_days(floor_div(now, DAY_MS))
    local ny, nm = y, m + 1
    if m == 12 then ny, nm = y + 1, 1 end
    id, start, stop = y * 12 + (m - 1), days_from_civil(y, m, 1) * DAY_MS,
      days_from_civil(ny, nm, 1) * DAY_MS
  end
  if ITEMS > 1 then PERIODS[len] = {now, id, start, stop} end
  return id, start, stop
end

-- Sliding window: {start, current, previous} rolled to now.
local function roll(w, now, window)
  local start = now - (now % window)
  if start <= w[1] then return end
  if start - w[1] == window then w[3] = w[2] else w[3] = 0 end
  w[2] = 0
  w[1] = start
end

local function weight_at(w, t, window)
  local elapsed = t - w[1]
  if elapsed < 0 then elapsed = 0 end
  if elapsed > window then elapsed = window end
  return floor_div((window - elapsed) * WEIGHT_SCALE, window)
end

local function scaled(w, t, window)
  return w[3] * weight_at(w, t, window) + w[2] * WEIGHT_SCALE
end

local function retry_after(w, now, window, limit)
  local function admits(t)
    local c = {w[1], w[2], w[3]}
    roll(c, t, window)
    return math.min(c[2] + 1, COUNT_CAP) * WEIGHT_SCALE + c[3] * weight_at(c, t, window) <= limit * WEIGHT_SCALE
  end
  if admits(now) then return 0 end
  local lo, hi = now, math.max(w[1] + 2 * window, now + 1)
  while lo + 1 < hi do
    local mid = lo + floor_div(hi - lo, 2)
    if admits(mid) then hi = mid else lo = mid end
  end
  return hi - now
end

-- Cost in micro-units, rounded up: exact while tokens per request stay under 10^9.
local function cost(price, input, cached, output)
  if cached > input then cached = input end
  local fresh = input - cached
  local whole, frac = 0, 0
  for _, p in ipairs({{fresh, price[1]}, {cached, price[2]}, {output, price[3]}}) do
    local a = floor_div(p[2], 1000000)
    whole = whole + p[1] * a
    frac = frac + p[1] * (p[2] - a * 1000000)
  end
  return whole + math.ceil(frac / 1000000)
end

-- A ticket is a msgpack array of strings: exp, ttl, price (3), expired usage (3), the number of
-- leases, the lease keys, then per reservation: key, field, unit, amount, period length, label.
-- Written from strings only (see int). cmsgpack is C: packing and unpacking cost less than
-- RPUSH and LRANGE of the same fields did.
local function write_ticket(tkey, t, keep_ms)
  local v = {t.exp, t.ttl, t.price[1], t.price[2], t.price[3], t.xu[1], t.xu[2], t.xu[3],
    int(#t.leases)}
  for _, k in ipairs(t.leases) do v[#v + 1] = k end
  for _, b in ipairs(t.budgets) do
    for j = 1, 6 do v[#v + 1] = b[j] end
  end
  redis.call('SET', tkey, cmsgpack.pack(v), 'PX', keep_ms)
end

-- How a request ended, as its ticket key holds it afterwards.
local ENDINGS = {settled = true, released = true, expired = true}

-- The ticket packed in `packed`. Its fields stay strings until used (tonumber is strtod, about
-- 0.2 µs each): a settlement of a token budget needs none of them as numbers.
local function ticket_of(packed)
  local v = cmsgpack.unpack(packed)
  local t = {exp = v[1], ttl = v[2], price = {v[3], v[4], v[5]}, xu = {v[6], v[7], v[8]},
    leases = {}, budgets = {}, raw = v}
  local n = num(v[9])
  for i = 1, n do t.leases[i] = v[9 + i] end
  for i = 10 + n, #v, 6 do
    t.budgets[#t.budgets + 1] = {v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5]}
  end
  return t
end

-- The ticket of an unfinished request at tkey, or nil.
local function peek_ticket(tkey)
  local packed = redis.call('GET', tkey)
  if not packed or ENDINGS[packed] then return nil end
  return ticket_of(packed)
end

-- Marks the request at tkey as ended (`ending`, kept for `retention` ms: the ARGV string) and
-- returns its ticket; or nil and how it had ended ('unknown': it never was admitted, or it was
-- forgotten).
local function take_ticket(tkey, ending, retention)
  local old = redis.call('SET', tkey, ending, 'PX', retention, 'GET')
  if not old then
    redis.call('DEL', tkey)
    return nil, 'unknown'
  end
  if ENDINGS[old] then
    -- Ended before: its ending goes back (the marker's retention restarts, which is harmless).
    redis.call('SET', tkey, old, 'KEEPTTL')
    return nil, old
  end
  return ticket_of(old), nil
end

-- Ends a ticket that take_ticket took: leases back, each reservation replaced by the charge for
-- the usage {input, cached, output} (nil: the ticket's expired usage), out of the expiry index.
-- Returns the charges.
local function end_ticket(id, t, usage, now)
  -- A lease whose expiry is ahead is in its set (only the sweep and the clean-up of a full set
  -- take members out, and only expired ones), so a known count goes down by one; otherwise the
  -- count is read again when next needed.
  local exp = t.exp
  local live
  if NOW_STR then
    -- Both '%d' strings: the longer, or at equal length the greater, is later (no strtod).
    live = #exp > #NOW_STR or (#exp == #NOW_STR and exp > NOW_STR)
  else
    live = num(exp) > now
  end
  for _, lkey in ipairs(t.leases) do
    local l = lease(lkey)
    local rem = l[3]
    if rem then rem[#rem + 1] = id else l[3] = {id} end
    if l[1] then
      if live then l[1] = l[1] - 1 else l[1] = false end
    end
  end
  local price = nil
  if usage == nil then usage = {num(t.xu[1]), num(t.xu[2]), num(t.xu[3])} end
  local charged = {}
  for _, b in ipairs(t.budgets) do
    local bkey, field, unit, len, label = b[1], b[2], b[3], b[5], b[6]
    local charge
    if unit == 't' then
      charge = usage[1] + usage[3]
    else
      if price == nil then price = {num(t.price[1]), num(t.price[2]), num(t.price[3])} end
      charge = cost(price, usage[1], usage[2], usage[3])
    end
    if field == label .. '@' .. int(period_at(num(len), now)) then
      local cell, amount = budget(bkey, field), num(b[4])
      cell[7] = cell[5] == 0 and '-' .. b[4]
      cell[4], cell[5] = cell[4] + charge, cell[5] - amount
      if cell[2] then cell[2], cell[3] = cell[2] + charge, cell[3] - amount end
    else
      -- An old period (rare; never the cell remembered, which is the current one): written at
      -- once, and dropped when nothing is outstanding in it.
      local left = redis.call('HINCRBY', bkey, field .. ':r', '-' .. b[4])
      if left <= 0 then
        redis.call('HDEL', bkey, field .. ':r', field .. ':s')
      else
        redis.call('HINCRBY', bkey, field .. ':s', int(charge))
      end
    end
    charged[#charged + 1] = charge
  end
  XREM[#XREM + 1] = id
  return charged
end

-- Expires up to `max` tickets whose time has come. `now_str`, `max` and `retention` are the
-- strings that Redis commands take (see store_now and take_ticket).
local function sweep(now, now_str, max, retention)
  local ids = redis.call('ZRANGEBYSCORE', PREFIX .. ':x', '-inf', now_str, 'LIMIT', '0', max)
  for _, id in ipairs(ids) do
    local t = take_ticket(PREFIX .. ':ts:' .. id, 'expired', retention)
    if t then
      end_ticket(id, t, nil, now)
    else
      XREM[#XREM + 1] = id
    end
  end
  -- Every script sweeps first: what follows may read these keys directly.
  if #ids > 0 then flush() end
end

-- The kill switch's targets and reasons, read once per call.
local function kill_table()
  local all = redis.call('HGETALL', PREFIX .. ':kill')
  local t = {}
  for i = 1, #all, 2 do t[all[i]] = all[i + 1] end
  return t
end

-- One admission: count the attempt in every rate scope, apply the token verdict, take a lease
-- in every concurrency scope and reserve in every budget scope, all or nothing.
--
-- A[a], ...: request id, ttl, retention, token_deny (0/1), n_rate, n_lease, n_budget, price
--   (input, cached input, output; 0 when none), expired usage (the same three), n_kill, the
--   kill-switch targets,
--   then per rate scope: key, limit, window; per lease scope: key, limit; per budget scope: key,
--   limit, unit (t|m), period length (0 = month), period label, amount.
-- Returns {'admit', expires_at, quota values...} | {'deny', reason, scope index, remaining,
--   retry_after (-1 none), reset (-1 none)} | {'token'} | {'dup'} | {'killed', target, reason}.
local function admit_one(A, a, now, kills, probe)
  ITEMS = ITEMS + 1
  if ITEMS == 2 then MEMO, PERIODS = {}, {} end
  local id, ttl, retention = A[a], num(A[a + 1]), num(A[a + 2])
  local token_deny = A[a + 3] == '1'
  local n_rate, n_lease, n_budget = num(A[a + 4]), num(A[a + 5]), num(A[a + 6])
  -- Price and expired usage only go into the ticket: kept as the strings they came in.
  local price = {A[a + 7], A[a + 8], A[a + 9]}
  local xu = {A[a + 10], A[a + 11], A[a + 12]}
  local ttl_arg = A[a + 1]
  local n_kill = num(A[a + 13])
  a = a + 14
  -- The kill switch comes before anything is counted.
  for i = 0, n_kill - 1 do
    local reason = kills[A[a + i]]
    if reason then return {'killed', A[a + i], reason} end
  end
  a = a + n_kill

  local tkey = PREFIX .. ':ts:' .. id
  if redis.call('EXISTS', tkey) > 0 then
    return {'dup'}
  end

  local quotas = {}
  -- 1. Rate: every attempt counts in every rate scope.
  local rate_fail = nil
  for i = 1, n_rate do
    local key, limit, window_arg = A[a], num(A[a + 1]), A[a + 2]
    local window = num(window_arg)
    a = a + 3
    -- The entry's first three are the window {start, current, previous} that roll() moves.
    local w = RATE[key]
    if w == nil then
      local h = redis.call('HMGET', key, 's', 'c', 'p', 'w')
      -- The start and the previous count change once a window: remembered like policy numbers.
      local s, c = num(h[1] or '0'), tonumber(h[2] or '0')
      w = {s, c, num(h[3] or '0'), h[4] or false, h[1] and s or -1, c, h[4] or false}
      RATE[key] = w
    end
    if w[4] ~= window_arg then
      -- Another window length (the policy changed): counting starts again.
      if w[4] then w[1], w[2], w[3] = 0, 0, 0 end
      w[4] = window_arg
    end
    roll(w, now, window)
    w[2] = math.min(w[2] + 1, COUNT_CAP)
    local count = scaled(w, now, window)
    local reset = w[1] + window - now
    if count > limit * WEIGHT_SCALE and rate_fail == nil then
      rate_fail = {'deny', 0, i - 1, 0, retry_after(w, now, window, limit), reset}
    end
    local used = math.ceil(count / WEIGHT_SCALE)
    quotas[#quotas + 1] = math.max(limit - used, 0)
    quotas[#quotas + 1] = reset
  end
  if rate_fail ~= nil then return rate_fail end
  -- 2-4. Token controls, decided by the caller.
  if token_deny then return {'token'} end
  -- 5. Concurrency.
  local leases = {}
  for i = 1, n_lease do
    local key, limit = A[a], num(A[a + 1])
    a = a + 2
    -- A lease leaves its set when its request ends or expires (the sweep), so the set's size
    -- (without the skiplist member) is the number held unless the sweep is behind; only at the
    -- limit are expired members taken out here and the set counted again. (Counting the
    -- unexpired members, ZCOUNT from now, walks them: about 20,000 instructions at 50.)
    local l = lease(key, true)
    local held = l[1]
    if held >= limit then
      lease_flush(key, l)
      redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
      held = redis.call('ZCOUNT', key, '-inf', '(+inf')
      l[1] = held
    end
    if held >= limit then
      local soonest = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES', 'LIMIT', '0', '1')
      local wait = 1000
      if soonest[2] ~= nil then wait = math.max(1, math.min(1000, tonumber(soonest[2]) - now)) end
      return {'deny', 4, i - 1, 0, wait, -1}
    end
    leases[#leases + 1] = key
    quotas[#quotas + 1] = limit - held - 1
  end
  -- 6. Budget: check all, then reserve all.
  local budgets = {}
  for i = 1, n_budget do
    local key, limit, unit, len, label, amount =
      A[a], num(A[a + 1]), A[a + 2], num(A[a + 3]), A[a + 4], num(A[a + 5])
    local len_arg, amount_arg = A[a + 3], A[a + 5]
    a = a + 6
    local pid, _, pend = period_at(len, now)
    local field = label .. '@' .. int(pid)
    local cell = budget(key, field, true)
    local committed = cell[2] + cell[3]
    if committed + amount > limit then
      local retry = -1
      if amount <= limit then retry = pend - now end
      return {'deny', 5, i - 1, math.max(limit - committed, 0), retry, pend - now}
    end
    local cur = cell[6]
    if cur == '' then cur = nil end
    budgets[#budgets + 1] = {key, field, unit, amount, len, label, pend, cur, amount_arg, len_arg}
    quotas[#quotas + 1] = limit - committed - amount
    quotas[#quotas + 1] = pend - now
  end
  -- A probe (sharded stores, after another shard refused) counts and checks, takes nothing.
  if probe then
    local out = {'admit', 0}
    for _, q in ipairs(quotas) do out[#out + 1] = q end
    return out
  end
  -- Everything passed: take the leases, make the reservations, record the ticket.
  local expires = now + ttl
  local expires_arg = int(expires)
  local keep = ttl + 60000
  for _, key in ipairs(leases) do
    local l = LEASE[key]
    local n = l[4]
    l[5 + n], l[6 + n], l[4] = expires_arg, id, n + 2
    l[1] = l[1] + 1
    if not l[2] or keep > l[2] then l[2] = keep end
  end
  local held = {}
  for _, b in ipairs(budgets) do
    local key, field, pend, cur = b[1], b[2], b[7], b[8]
    local cell = BUDGET[key]
    if cur ~= field then
      -- A new period (rare, written at once): drop the previous one unless reservations still
      -- settle into it. (The cell remembered is this period's, not the previous one.)
      budget_flush(key, cell)
      if cur and tonumber(redis.call('HGET', key, cur .. ':r') or '0') <= 0 then
        redis.call('HDEL', key, cur .. ':r', cur .. ':s')
      end
      redis.call('HSET', key, 'cur', field)
      cell[6] = field
    end
    cell[7] = cell[5] == 0 and b[9]
    cell[3], cell[5] = cell[3] + b[4], cell[5] + b[4]
    -- Kept through the period, and while any reservation in it may still settle: set when the
    -- period starts, and again only for a reservation that outlives the period.
    if cur ~= field or ttl > pend - now then
      redis.call('PEXPIRE', key, int(math.max(pend - now, ttl) + retention))
    end
    held[#held + 1] = {key, field, b[3], b[9], b[10], b[6]}
  end
  write_ticket(tkey, {exp = expires_arg, ttl = ttl_arg, price = price, xu = xu, leases = leases,
    budgets = held}, int(ttl + retention))
  XADD[#XADD + 1] = expires_arg
  XADD[#XADD + 1] = id
  local out = {'admit', expires}
  for _, q in ipairs(quotas) do out[#out + 1] = q end
  return out
end

-- Undoes this shard's part of an admission that another shard refused (sharded stores): leases
-- and reservations back, no charge, no finished marker (the request never was admitted).
-- A[a]: request id. Returns {'undone'} | {'unknown'}.
local function undo_one(A, a)
  -- Rare (a sharded store's roll-back): done directly, with nothing pending or remembered.
  flush(true)
  local id = A[a]
  local tkey = PREFIX .. ':ts:' .. id
  local t = peek_ticket(tkey)
  if not t then return {'unknown'} end
  for _, lkey in ipairs(t.leases) do redis.call('ZREM', lkey, id) end
  for _, b in ipairs(t.budgets) do redis.call('HINCRBY', b[1], b[2] .. ':r', '-' .. b[4]) end
  redis.call('DEL', tkey)
  redis.call('ZREM', PREFIX .. ':x', id)
  return {'undone'}
end

-- One settlement or release. Idempotent: a second call answers how the request ended.
--
-- A[a], ...: request id, retention, ending (settled|released), whether usage follows (0/1),
--   usage: input, cached input, output (without usage: the ticket's expired usage).
-- Returns {'done', charges...} | {'ended', ending} | {'unknown'}.
local function finish_one(A, a, now)
  ITEMS = ITEMS + 1
  if ITEMS == 2 then MEMO, PERIODS = {}, {} end
  local id, retention, ending = A[a], A[a + 1], A[a + 2]
  local t, how = take_ticket(PREFIX .. ':ts:' .. id, ending, retention)
  if not t then
    if how == 'unknown' then return {'unknown'} end
    return {'ended', how}
  end
  local usage = nil
  if A[a + 3] == '1' then usage = {tonumber(A[a + 4]), tonumber(A[a + 5]), tonumber(A[a + 6])} end
  local out = {'done'}
  for _, c in ipairs(end_ticket(id, t, usage, now)) do
    out[#out + 1] = c
  end
  return out
end
