-- The ledger: tickets, admission, settlement and expiry, over the controls' checks
-- (controls/*.lua, assembled before this file). Its state and conversions are common.lua's.

-- (id, start, end) of the period containing now, for a period length (0: a month).
local period_at = period_of

-- Cost in micro-units, rounded up: exact while tokens per request stay under 10^9. (No tables:
-- inside Redis a table costs its allocation, its growth and its collection.) Prompt-cache
-- writes (w5: five minutes, w1h: one hour; part of the fresh input) add a quarter or one whole
-- input price, rounded up on their own, as Price::cost in crates/core/src/ledger.rs does.
local function cost(price, input, cached, output, w5, w1h)
  if cached > input then cached = input end
  local whole, frac, n = 0, 0, input - cached
  local fresh = n
  for k = 1, 3 do
    if k == 2 then n = cached elseif k == 3 then n = output end
    local p = price[k]
    local a = math.floor(p / 1000000)
    whole = whole + n * a
    frac = frac + n * (p - a * 1000000)
  end
  whole = whole + math.ceil(frac / 1000000)
  if w5 > 0 or w1h > 0 then
    if w5 > fresh then w5 = fresh end
    if w1h > fresh - w5 then w1h = fresh - w5 end
    -- (w5 / 4 + w1h) * p / 10^6, in quarter micro-units for the fractions: each product stays
    -- under 2^53 (4 * 10^15 apiece) while tokens per request stay under 10^9.
    local p = price[1]
    local a5, a1 = math.floor(p / 4000000), math.floor(p / 1000000)
    whole = whole + w5 * a5 + w1h * a1
      + math.ceil((w5 * (p - a5 * 4000000) + 4 * w1h * (p - a1 * 1000000)) / 4000000)
  end
  return whole
end

-- A ticket is a msgpack array: [1] exp, [2] ttl, [3..5] price, [6..8] expired usage, [9] the
-- number of leases n, [10..9+n] the lease keys, then per reservation: key, field, unit ('t'
-- tokens, 'm<f>' money, f micro-units of fees charged without usage (none: 'm'), 'c<n>' tool
-- calls, n of them charged without usage; in capitals for a
-- shadow rule's), amount, period length, label. Strings, as they came in or formatted by int,
-- except n, a number (msgpack keeps an integer as one; read as `0 + v[9]`, which takes the
-- string an earlier build wrote as well). cmsgpack is C: packing and unpacking cost less than
-- RPUSH and LRANGE of the same fields did. The scripts read it as the array cmsgpack.unpack
-- makes, by position: a table per part cost more than the reading.

-- How a request ended, as its ticket key holds it afterwards.
local ENDINGS = {settled = true, released = true, expired = true}

-- The ticket of an unfinished request at tkey, or nil.
local function peek_ticket(tkey)
  local packed = redis.call('GET', tkey)
  if not packed or ENDINGS[packed] then return nil end
  return cmsgpack.unpack(packed)
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
  return cmsgpack.unpack(old), nil
end

-- Ends a ticket `v` that take_ticket took: leases back, each reservation replaced by the charge
-- for the usage (input, cached input, output, cache writes for five minutes and for one hour,
-- tool calls, fees; without it, the ticket's expired usage), out of the expiry index. Appends
-- the charges to `out` when given.
local function end_ticket(id, v, now, out, input, cached, output, w5, w1h, calls, fees)
  -- A lease whose expiry is ahead is in its set (only the sweep and the clean-up of a full set
  -- take members out, and only expired ones), so a known count goes down by one; otherwise the
  -- count is read again when next needed.
  local exp = v[1]
  local live
  if NOW_STR then
    -- Both '%d' strings: the longer, or at equal length the greater, is later (no strtod).
    live = #exp > #NOW_STR or (#exp == #NOW_STR and exp > NOW_STR)
  else
    live = num(exp) > now
  end
  local n = num(v[9])
  for i = 10, 9 + n do
    local l = lease(v[i])
    local rem = l[3]
    if rem then rem[#rem + 1] = id else l[3] = {id} end
    if l[1] then
      if live then l[1] = l[1] - 1 else l[1] = false end
    end
  end
  if input == nil then input, cached, output, w5, w1h = num(v[6]), num(v[7]), num(v[8]), 0, 0 end
  local price = nil
  for i = 10 + n, #v, 6 do
    local bkey, field, amount = v[i], v[i + 1], v[i + 3]
    -- A shadow rule's unit is in capitals: charged the same, not reported as the request's.
    local charge, unit = nil, v[i + 2]
    local u = string.byte(unit)
    if u == 116 or u == 84 then
      -- 't': tokens.
      charge = input + output
    elseif u == 99 or u == 67 then
      -- 'c': tool calls.
      charge = calls or num(string.sub(unit, 2))
    else
      if price == nil then price = {num(v[3]), num(v[4]), num(v[5])} end
      -- 'm': money, plus the usage's fees (without usage, those the unit carries).
      charge = cost(price, input, cached, output, w5, w1h)
        + (fees or (#unit > 1 and num(string.sub(unit, 2))) or 0)
    end
    if field == v[i + 5] .. '@' .. int(period_at(v[i + 4], now)) then
      local cell, reserved = budget(bkey, field), num(amount)
      cell[7] = cell[5] == 0 and '-' .. amount
      cell[4], cell[5] = cell[4] + charge, cell[5] - reserved
      if cell[2] then cell[2], cell[3] = cell[2] + charge, cell[3] - reserved end
    else
      -- An old period (rare; never the cell remembered, which is the current one): written at
      -- once, and dropped when nothing is outstanding in it.
      local left = redis.call('HINCRBY', bkey, field .. ':r', '-' .. amount)
      if left <= 0 then
        redis.call('HDEL', bkey, field .. ':r', field .. ':s', field .. ':c')
      else
        redis.call('HINCRBY', bkey, field .. ':s', int(charge))
      end
    end
    if out and u > 96 then out[#out + 1] = charge end
  end
  XREM[#XREM + 1] = id
end

-- An expired request's charges, for a spend ledger: appended to the stream `P:expired` (at
-- most about 100,000 entries) while `P:ledger` exists, which instances keeping a ledger write.
-- Fields: id, at, then per reservation k (budget key), f (period field), u (unit), l (period
-- length), c (charge).
local function expiry_entry(id, v, now_str, out)
  local args = {PREFIX .. ':expired', 'MAXLEN', '~', '100000', '*', 'id', id, 'at', now_str}
  local j = 1
  for i = 10 + num(v[9]), #v, 6 do
    -- A shadow rule's reservation (its unit in capitals) is no spend.
    if string.byte(v[i + 2]) > 96 then
      local n = #args
      args[n + 1], args[n + 2], args[n + 3], args[n + 4] = 'k', v[i], 'f', v[i + 1]
      args[n + 5], args[n + 6], args[n + 7], args[n + 8] = 'u', v[i + 2], 'l', v[i + 4]
      args[n + 9], args[n + 10] = 'c', int(out[j])
      j = j + 1
    end
  end
  redis.call('XADD', unpack(args))
end

-- A slice's ticket (slices.lua) is a msgpack array: [1] '~L' and a lease set's key, its
-- slots ([3]); or [1] '~B', the budget key, its period field, unit, amount held, settled
-- reported so far, period length and label. Its slots are members '<slice id>#<n>', n = 1 to
-- the slots, of the lease set, scored by the slice's expiry.

-- Expires the slice `id` whose ticket is `v`: its slots leave their set, its reservation is
-- charged in full (what its instance spent of it since its last report is unknown), written
-- for a spend ledger when one keeps expiries.
local function expire_slice(id, v, now_str, ledger)
  if v[1] == '~L' then
    local n = tonumber(v[3])
    local members = {}
    for i = 1, n do members[i] = id .. '#' .. i end
    if n > 0 then redis.call('ZREM', v[2], unpack(members)) end
    return
  end
  local key, field, amount = v[2], v[3], v[5]
  redis.call('HINCRBY', key, field .. ':s', amount)
  local left = redis.call('HINCRBY', key, field .. ':r', '-' .. amount)
  if left <= 0 and redis.call('HGET', key, 'cur') ~= field then
    redis.call('HDEL', key, field .. ':r', field .. ':s')
  end
  if ledger then
    redis.call('XADD', PREFIX .. ':expired', 'MAXLEN', '~', '100000', '*', 'id', id, 'at', now_str,
      'k', key, 'f', field, 'u', v[4], 'l', v[7], 'c', amount)
  end
end

-- Expires up to `max` tickets whose time has come. `now_str`, `max` and `retention` are the
-- strings that Redis commands take (see store_now and take_ticket).
local function sweep(now, now_str, max, retention)
  local ids = redis.call('ZRANGEBYSCORE', PREFIX .. ':x', '-inf', now_str, 'LIMIT', '0', max)
  local ledger = nil
  for _, id in ipairs(ids) do
    local v = take_ticket(PREFIX .. ':ts:' .. id, 'expired', retention)
    if v and (v[1] == '~L' or v[1] == '~B') then
      -- A slice: its cached keys are written first, and read again after.
      flush(true)
      if ledger == nil then ledger = redis.call('EXISTS', PREFIX .. ':ledger') == 1 end
      expire_slice(id, v, now_str or int(now), ledger)
      XREM[#XREM + 1] = id
    elseif v then
      if ledger == nil then ledger = redis.call('EXISTS', PREFIX .. ':ledger') == 1 end
      if ledger then
        local out = {}
        end_ticket(id, v, now, out)
        expiry_entry(id, v, now_str or int(now), out)
      else
        end_ticket(id, v, now)
      end
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

-- A refusal by one of the plan's checks, in the `deny` layout of crates/redis/src/contract.rs
-- (Lua's tables count from 1): its place in the plan (from 0), what is left and the waits (-1:
-- none). The Rust side knows the check's reason by its place.
local function deny(check, remaining, retry, reset)
  local r = {}
  r[@deny.kind + 1], r[@deny.check + 1] = 'deny', check
  r[@deny.remaining + 1], r[@deny.retry_after + 1], r[@deny.reset + 1] = remaining, retry, reset
  return r
end

-- Takes the leases of the n lease checks whose layouts start at A[al[1]], ..., A[al[n]]
-- (checked, so their entries are read) for request id, into the call's pending state and the
-- ticket v, whose last value set is v[nv]. Returns the new nv.
local function take_leases(A, al, n, id, expires_arg, keep, v, nv)
  for i = 1, n do
    local key = A[al[i] + @lease.key]
    local l = LEASE[key]
    local k = l[4]
    l[5 + k], l[6 + k], l[4] = expires_arg, id, k + 2
    l[1] = l[1] + 1
    if not l[2] or keep > l[2] then l[2] = keep end
    nv = nv + 1
    v[nv] = key
  end
  return nv
end

-- Makes the reservations of the n reservation checks whose layouts start at A[ab[1]], ...,
-- with what their checks found (bud: four values per check), into the pending state and the
-- ticket v. A shadow rule's unit goes into the ticket in capitals (see end_ticket). Returns the
-- new nv.
local function take_budgets(A, ab, n, bud, now, ttl, retention, v, nv, shadow)
  for i = 1, n do
    local b, k = ab[i], 4 * (i - 1)
    local key, field, pend, cur, amount = A[b + @budget.key], bud[k + 1], bud[k + 2], bud[k + 3], bud[k + 4]
    local cell = BUDGET[key]
    if cur ~= field then
      -- A new period (rare, written at once): drop the previous one unless reservations still
      -- settle into it. (The cell remembered is this period's, not the previous one.)
      budget_flush(key, cell)
      if cur and tonumber(redis.call('HGET', key, cur .. ':r') or '0') <= 0 then
        redis.call('HDEL', key, cur .. ':r', cur .. ':s', cur .. ':c')
      end
      redis.call('HSET', key, 'cur', field)
      if cell[8] > 0 then redis.call('HSET', key, field .. ':c', int(cell[8])) end
      cell[6] = field
    end
    cell[7] = cell[5] == 0 and A[b + @budget.amount]
    cell[3], cell[5] = cell[3] + amount, cell[5] + amount
    -- Kept through the period, and while any reservation in it may still settle: set when the
    -- period starts, and again only for a reservation that outlives the period.
    if cur ~= field or ttl > pend - now then
      local keep = math.max(pend - now, ttl) + retention
      if A[b + @budget.carry] ~= '0' then
        -- Through the next period too, which finds its carry in this one.
        local _, start, stop = period_at(A[b + @budget.period_len], now)
        keep = keep + stop - start
      end
      redis.call('PEXPIRE', key, int(keep))
    end
    local unit = A[b + @budget.unit]
    if shadow then unit = string.upper(unit) end
    -- key, field, unit, amount, period length, label
    v[nv + 1], v[nv + 2], v[nv + 3], v[nv + 4], v[nv + 5], v[nv + 6] =
      key, field, unit, A[b + @budget.amount], A[b + @budget.period_len], A[b + @budget.label]
    nv = nv + 6
  end
  return nv
end

-- The arguments a check takes after its `check` layout, by its kind.
local CHECK_ARGS = {r = @rate#, k = @rate#, q = @rate#, l = @lease#, b = @budget#, v = 0}

-- Counts one attempt in the count whose `rate` layout starts at A[a]: whether it went over,
-- what is left, the time to the reset and the wait.
local function count_at(A, a, now)
  local key, limit, window_arg = A[a + @rate.key], num(A[a + @rate.limit]), A[a + @rate.window]
  local window = num(window_arg)
  -- The entry's first three are the window {start, current, previous} that roll() moves.
  local w = RATE[key]
  if w == nil then
    local h = redis.call('HMGET', key, 's', 'c', 'p', 'w')
    -- The start and the previous count change once a window: remembered like policy numbers.
    local s, c = num(h[1] or '0'), 0 + (h[2] or 0)
    w = {s, c, num(h[3] or '0'), h[4] or false, h[1] and s or -1, c, h[4] or false}
    RATE[key] = w
  end
  if w[4] ~= window_arg then
    -- Another window length (the policy changed): counting starts again.
    if w[4] then w[1], w[2], w[3] = 0, 0, 0 end
    w[4] = window_arg
  end
  return rate_count(w, now, window, limit)
end

-- The window at A[a] read, not counted nor written (another length, or none, reads empty).
local function peek_at(A, a, now)
  local key, window_arg = A[a + @rate.key], A[a + @rate.window]
  local w = RATE[key] or redis.call('HMGET', key, 's', 'c', 'p', 'w')
  if w[4] ~= window_arg then w = {0, 0, 0} end
  return rate_peek(w, now, num(window_arg), num(A[a + @rate.limit]))
end

-- The lease check whose `lease` layout starts at A[a]: the leases left after it, or nil and the
-- wait.
local function lease_at(A, a, now)
  local key, limit = A[a + @lease.key], num(A[a + @lease.limit])
  -- A lease leaves its set when its request ends or expires (the sweep), so the set's size
  -- (without the skiplist member) is the number held unless the sweep is behind; only at the
  -- limit are expired members taken out here and the set counted again (counting the
  -- unexpired members, ZCOUNT from now, walks every one of them).
  local l = lease(key, true)
  local held = l[1]
  if held >= limit then
    lease_flush(key, l)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
    held = redis.call('ZCOUNT', key, '-inf', '(+inf')
    l[1] = held
  end
  local soonest = nil
  if held >= limit then
    local s = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES', 'LIMIT', '0', '1')
    if s[2] ~= nil then soonest = tonumber(s[2]) end
  end
  return lease_verdict(held, limit, soonest, now)
end

-- The reservation check whose `budget` layout starts at A[a]: whether it fits, what is left,
-- the wait, the period's end and field, and the current field (false when none).
local function budget_at(A, a, now)
  local key, limit, len = A[a + @budget.key], num(A[a + @budget.limit]), A[a + @budget.period_len]
  local label, amount = A[a + @budget.label], num(A[a + @budget.amount])
  local pid, pstart, pend = period_at(len, now)
  local field = label .. '@' .. int(pid)
  local cell = budget(key, field, true)
  local cur = cell[6]
  if cur == '' then cur = false end
  -- Most budgets carry nothing over: '0' is known without a conversion.
  local cap = A[a + @budget.carry]
  if cap ~= '0' and cur ~= field then
    cap = num(cap)
    -- A new period: it carries over what the period just before left unused (and nothing
    -- after an idle period). Kept with the cell once a reservation starts the period.
    local before = label .. '@' .. int(period_at(len, pstart - 1))
    cell[8] = 0
    if cur == before then
      local h = redis.call('HMGET', key, before .. ':s', before .. ':r', before .. ':c')
      cell[8] = carried(cap, limit, 0 + (h[3] or 0), (h[1] or 0) + (h[2] or 0))
    end
  end
  local fits, left, retry = budget_verdict(cell[2] + cell[3], amount, limit + cell[8], pend, now)
  return fits, left, retry, pend, field, cur, amount
end

-- The first of the n kill-switch targets at A[a], ... that is switched off, as a `killed`
-- reply; nil when none is. A[a0] is the admission's header.
local function killed(A, a, n, kills, now, a0)
  for i = 0, n - 1 do
    local reason = kills[A[a + i]]
    if reason and string.sub(reason, 1, 5) == 'hold ' then
      -- A provider's hold, 'hold <until> <reason>' (Killed::kept in crates/core/src/
      -- decision.rs): no switch once its instant has passed, nor for a request of at most
      -- <n> tokens when its reason starts 'over <n> '.
      local ends = tonumber(string.match(reason, '^hold (%d+) '))
      local over = tonumber(string.match(reason, '^hold %d+ over (%d+) '))
      -- The request's size is read only here: few admissions meet a hold.
      if ends == nil or now >= ends or (over and num(A[a0 + @admit.size]) <= over) then
        reason = nil
      end
    end
    if reason then
      local r = {}
      r[@killed.kind + 1], r[@killed.target + 1], r[@killed.reason + 1] = 'killed', A[a + i], reason
      return r
    end
  end
  return nil
end

-- One admission: walk the checks in the plan's order, counting the attempt in every count, to
-- the first refusal (a count over its limit, a verdict, a full lease set, a budget without
-- room), then take a lease for every lease check and reserve for every reservation, all or
-- nothing. The script knows the checks' kinds, never their controls: a refusal names its check
-- by its place.
--
-- A[a], ...: the header (the `admit` layout of crates/redis/src/contract.rs), the kill-switch
--   targets, then per check its `check` layout (kind) and its kind's (`rate`, `lease`,
--   `budget`: unit t|m|c<n>, period length 0 for a month; none for a verdict).
-- Returns {'admit', expires_at, a `quota` per check} | a refusal in the `deny` layout |
--   {'dup'} | {'killed', target, reason}.
-- `known`: the id was checked for a duplicate already. `shadow`: what a shadow plan's probe
-- (in the same A) found, {start, lease places, n_lease, budget places, n_budget, its checks'
-- table}, to take into this ticket as well when this admission passes.
local function admit_one(A, a, now, kills, probe, shadow, known)
  local id, ttl, retention, a0, n_check, n_kill
  if probe == 'shadow' then
    -- A shadow plan's header (admit_shadowed): its checks' number, nothing for a ticket.
    n_check, n_kill, a = num(A[a + @shadow.n_check]), 0, a + @shadow#
  else
    id, ttl, retention = A[a + @admit.id], num(A[a + @admit.ttl]), num(A[a + @admit.retention])
    n_check = num(A[a + @admit.n_check])
    -- Price and expired usage only go into the ticket: kept as the strings they came in, and
    -- read where they are (no table of their own).
    a0 = a
    -- Most plans name no kill target: '0' is known without a conversion.
    n_kill = A[a + @admit.n_kill]
    n_kill = n_kill == '0' and 0 or num(n_kill)
    a = a + @admit#
  end
  -- The kill switch comes before anything is counted.
  if n_kill > 0 then
    local r = killed(A, a, n_kill, kills, now, a0)
    if r then return r end
  end
  a = a + n_kill

  if not known and redis.call('EXISTS', PREFIX .. ':ts:' .. id) > 0 then
    return {'dup'}
  end

  -- The reply: a quota per check at its place, the second value, the expiry, set at the end.
  -- Made with room for three quotas: a table grown one value at a time is copied at every
  -- power of two.
  local out = {nil, nil, nil, nil, nil, nil, nil, nil}
  out[@admitted.kind + 1], out[@admitted.expires_at + 1] = 'admit', 0
  -- One walk in the plan's order. Every attempt counts in every count, whatever refuses it, so
  -- the walk goes on past the first refusal, counting and nothing else. What a reservation
  -- needs beyond A goes into one flat table, four values per reservation: the period's field,
  -- its end, the current field (false when none) and the amount.
  local refused = nil
  local al, nl, ab, nb, bud = {}, 0, {}, 0, {}
  for i = 1, n_check do
    local kind = A[a + @check.kind]
    local q = @admitted# + (i - 1) * @quota# + 1
    a = a + @check#
    if kind == 'r' then
      local went_over, left, reset, retry = count_at(A, a, now)
      if went_over and refused == nil then refused = deny(i - 1, 0, retry, reset) end
      out[q + @quota.remaining], out[q + @quota.reset] = left, reset
    elseif kind == 'q' then out[q + @quota.remaining], out[q + @quota.reset] = peek_at(A, a, now)
    elseif refused ~= nil then
      -- Past a refusal: nothing but the counts.
    elseif kind == 'k' then
      -- Counted already (the attempt_counted plan): the Rust side keeps its quota.
      out[q + @quota.remaining], out[q + @quota.reset] = 0, -1
    elseif kind == 'v' then
      refused = deny(i - 1, 0, -1, -1)
    elseif kind == 'l' then
      local left, wait = lease_at(A, a, now)
      if left == nil then
        refused = deny(i - 1, 0, wait, -1)
      else
        nl = nl + 1
        al[nl] = a
        out[q + @quota.remaining], out[q + @quota.reset] = left, -1
      end
    elseif kind == 'b' then
      local fits, left, retry, pend, field, cur, amount = budget_at(A, a, now)
      if not fits then
        refused = deny(i - 1, left, retry, pend - now)
      else
        local k = 4 * nb
        nb = nb + 1
        ab[nb] = a
        bud[k + 1], bud[k + 2], bud[k + 3], bud[k + 4] = field, pend, cur, amount
        out[q + @quota.remaining], out[q + @quota.reset] = left, pend - now
      end
    end
    a = a + CHECK_ARGS[kind]
  end
  if refused ~= nil then return refused end
  -- A probe (sharded stores, after another shard refused; a shadow plan) counts and checks,
  -- takes nothing, and says where what it would take is.
  if probe then return out, al, nl, ab, nb, bud end
  -- Everything passed: take the leases, make the reservations, record the ticket (its layout
  -- is above peek_ticket), built as it goes.
  local expires = now + ttl
  local expires_arg = int(expires)
  local keep = ttl + 60000
  local n_lease = nl
  if shadow then n_lease = nl + shadow[3] end
  -- With room for a lease and a reservation (nil until set; cmsgpack packs what is set).
  local v = {expires_arg, A[a0 + @admit.ttl], A[a0 + @admit.price_input],
    A[a0 + @admit.price_cached], A[a0 + @admit.price_output], A[a0 + @admit.expired_input],
    A[a0 + @admit.expired_cached], A[a0 + @admit.expired_output], n_lease,
    nil, nil, nil, nil, nil, nil, nil}
  local nv = take_leases(A, al, nl, id, expires_arg, keep, v, 9)
  if shadow then
    -- The shadow's checks passed: its leases and reservations are held by this ticket.
    nv = take_leases(A, shadow[2], shadow[3], id, expires_arg, keep, v, nv)
  end
  nv = take_budgets(A, ab, nb, bud, now, ttl, retention, v, nv, false)
  if shadow then
    take_budgets(A, shadow[4], shadow[5], shadow[6], now, ttl, retention, v, nv, true)
  end
  redis.call('SET', PREFIX .. ':ts:' .. id, cmsgpack.pack(v), 'PX', int(ttl + retention))
  XADD[#XADD + 1] = expires_arg
  XADD[#XADD + 1] = id
  out[@admitted.expires_at + 1] = expires
  return out
end

-- An admission with the plan of its shadow rules (op 's'). A[a]: the number m of the request's
-- arguments; then the request's (as admit_one reads them), then the shadow plan's header (the
-- `shadow` layout of crates/redis/src/contract.rs), then its scopes as admit_one reads them
-- (no id, TTL, price or kill targets: its holds go into the request's ticket). The shadow
-- is checked first, its attempts counted and nothing taken (its scopes are its rules', never
-- the request's, so the request's admission leaves its checks true); the request's admission
-- then takes the shadow's leases and reservations into its own ticket when both pass. A known
-- id counts nowhere. Returns {'dup'} or {'shadowed', the request's reply, the shadow's}: the
-- probe's refusal (in the `deny` layout, of the shadow plan), or {'held'} or {'passed'}
-- (it would have admitted; the request was not admitted, so nothing is held).
local function admit_shadowed(A, a, now, kills)
  local e = a + 1
  local s = e + num(A[a])
  if redis.call('EXISTS', PREFIX .. ':ts:' .. A[e + @admit.id]) > 0 then return {'dup'} end
  local probe, al, nl, ab, nb, bud = admit_one(A, s, now, kills, 'shadow', nil, true)
  if probe[@admitted.kind + 1] ~= 'admit' then
    return {'shadowed', admit_one(A, e, now, kills, false, nil, true), probe}
  end
  local reply = admit_one(A, e, now, kills, false, {s, al, nl, ab, nb, bud}, true)
  if reply[@admitted.kind + 1] == 'admit' then return {'shadowed', reply, {'held'}} end
  return {'shadowed', reply, {'passed'}}
end

-- Undoes this shard's part of an admission that another shard refused (sharded stores): leases
-- and reservations back, no charge, no finished marker (the request never was admitted).
-- A[a]: request id. Returns {'undone'} | {'unknown'}.
local function undo_one(A, a)
  -- Rare (a sharded store's roll-back): done directly, with nothing pending or remembered.
  flush(true)
  local id = A[a]
  local tkey = PREFIX .. ':ts:' .. id
  local v = peek_ticket(tkey)
  if not v then return {'unknown'} end
  local n = tonumber(v[9])
  for i = 10, 9 + n do redis.call('ZREM', v[i], id) end
  for i = 10 + n, #v, 6 do redis.call('HINCRBY', v[i], v[i + 1] .. ':r', '-' .. v[i + 3]) end
  redis.call('DEL', tkey)
  redis.call('ZREM', PREFIX .. ':x', id)
  return {'undone'}
end

-- A count from its ARGV string: most settlements have no cached input, cache writes or tool
-- calls, and '0' is known without a conversion (see num).
local function count_arg(s)
  if s == '0' then return 0 end
  return 0 + s
end

-- One settlement or release. Idempotent: a second call answers how the request ended.
--
-- A[a], ...: the `finish` layout of crates/redis/src/contract.rs (ending settled|released;
--   without usage, the ticket's expired usage is charged).
-- Returns {'done', charges...} | {'ended', ending} | {'unknown'}.
local function finish_one(A, a, now)
  local id, retention, ending = A[a + @finish.id], A[a + @finish.retention], A[a + @finish.ending]
  -- A slice is ended by its own orders, never as a request.
  if string.sub(id, 1, 3) == '~s:' then return {'unknown'} end
  local v, how = take_ticket(PREFIX .. ':ts:' .. id, ending, retention)
  if not v then
    if how == 'unknown' then return {'unknown'} end
    local r = {}
    r[@ended.kind + 1], r[@ended.how + 1] = 'ended', how
    return r
  end
  local out = {}
  out[@done.kind + 1] = 'done'
  if A[a + @finish.has_usage] == '1' then
    end_ticket(id, v, now, out, 0 + A[a + @finish.input], count_arg(A[a + @finish.cached]),
      0 + A[a + @finish.output], count_arg(A[a + @finish.write_5m]),
      count_arg(A[a + @finish.write_1h]), count_arg(A[a + @finish.tool_calls]),
      count_arg(A[a + @finish.fees]))
  else
    end_ticket(id, v, now, out)
  end
  return out
end
