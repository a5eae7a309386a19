-- Slices (tollgate_core::slices): an instance's orders for what it holds of hot scopes, in one
-- item of a batch call (op 'S'). Prepended with common.lua; rare next to admissions, so its
-- steps read and write keys directly, after writing what the call's earlier items left pending.
-- Every order but a rate take names totals, not changes, so that one sent again after a lost
-- answer does nothing twice. Mirrors crates/core/src/memory/slices.rs. Reply kinds:
-- SLICE_REPLIES.

-- What one grant may take of `free`: free / divisor, at least 1 while anything is free.
local function share(free, divisor)
  if free <= 0 then return 0 end
  return math.max(1, math.floor(free / divisor))
end

-- Rate: A[a..]: the `rate_order` layout of crates/redis/src/contract.rs. Gives back `back`
-- attempts counted ahead in the window that started at back_start (or in it as the previous
-- window), then counts up to `take` more ahead. Returns a `rate_grant` and the next index.
local function rate_order(A, a, now, divisor)
  local key, limit = A[a + @rate_order.key], tonumber(A[a + @rate_order.limit])
  local window_arg = A[a + @rate_order.window]
  local window, take = tonumber(window_arg), tonumber(A[a + @rate_order.take])
  local back, back_start = tonumber(A[a + @rate_order.back]), tonumber(A[a + @rate_order.back_start])
  local h = redis.call('HMGET', key, 's', 'c', 'p', 'w')
  local w = {tonumber(h[1] or '0'), tonumber(h[2] or '0'), tonumber(h[3] or '0')}
  if h[4] and h[4] ~= window_arg then w = {0, 0, 0} end
  local start0 = w[1]
  roll(w, now, window)
  if back > 0 then
    if w[1] == back_start then
      w[2] = math.max(w[2] - back, 0)
    elseif w[1] == back_start + window then
      w[3] = math.max(w[3] - back, 0)
    end
  end
  local free = math.floor((limit * 10000 - scaled(w, now, window)) / 10000)
  local granted = math.min(take, share(free, divisor))
  w[2] = math.min(w[2] + granted, 2147483648)
  redis.call('HSET', key, 's', int(w[1]), 'c', int(w[2]), 'p', int(w[3]), 'w', window_arg)
  if w[1] ~= start0 or not h[1] then redis.call('PEXPIRE', key, int(2 * window + 1000)) end
  local r = {}
  r[@rate_grant.granted + 1], r[@rate_grant.start + 1] = granted, w[1]
  r[@rate_grant.current + 1], r[@rate_grant.previous + 1] = w[2], w[3]
  return r, a + @rate_order#
end

-- A lease order's answer.
local function lease_grant(slots, held)
  local r = {}
  r[@lease_grant.slots + 1], r[@lease_grant.held + 1] = slots, held
  return r
end

-- A budget order's answer.
local function budget_grant(amount, committed)
  local r = {}
  r[@budget_grant.amount + 1], r[@budget_grant.committed + 1] = amount, committed
  return r
end

-- The ticket of slice `id` (its array), or nil and whether it ended ('gone') or never was.
local function slice_ticket(id)
  local packed = redis.call('GET', PREFIX .. ':ts:' .. id)
  if not packed then return nil, false end
  if ENDINGS[packed] then return nil, true end
  return cmsgpack.unpack(packed), false
end

-- Keeps slice `id`'s ticket `v` until `now + ttl` (then the sweep expires it), or ends it when
-- it holds nothing.
local function keep_slice(id, v, empty, now, ttl, retention)
  local tkey = PREFIX .. ':ts:' .. id
  if empty then
    redis.call('SET', tkey, 'released', 'PX', retention)
    redis.call('ZREM', PREFIX .. ':x', id)
    return
  end
  local exp = int(now + ttl)
  redis.call('SET', tkey, cmsgpack.pack(v), 'PX', int(ttl + tonumber(retention)))
  redis.call('ZADD', PREFIX .. ':x', exp, id)
  if redis.call('PTTL', PREFIX .. ':x') < ttl + tonumber(retention) then
    redis.call('PEXPIRE', PREFIX .. ':x', int(ttl + tonumber(retention)))
  end
  return exp
end

-- Slots: A[a..]: the `lease_order` layout. Returns a `lease_grant` or {'gone'}, and the next
-- index.
local function lease_order(A, a, now, divisor, retention)
  local id, key = A[a + @lease_order.slice], A[a + @lease_order.key]
  local limit, want = tonumber(A[a + @lease_order.limit]), tonumber(A[a + @lease_order.slots])
  local ttl, create = tonumber(A[a + @lease_order.ttl]), A[a + @lease_order.create] == '1'
  local v, ended = slice_ticket(id)
  local count = function() return redis.call('ZCOUNT', key, '-inf', '(+inf') end
  if not v then
    if ended or not create then return {'gone'}, a + @lease_order# end
    if want == 0 then return lease_grant(0, count()), a + @lease_order# end
    v = {'~L', key, '0'}
  end
  local n = tonumber(v[3])
  local exp = int(now + ttl)
  if want > n then
    local held = count()
    if held + want - n > limit then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
      held = count()
    end
    local grow = math.min(want - n, share(limit - held, divisor))
    n = n + grow
  elseif want < n then
    local gone = {}
    for i = want + 1, n do gone[#gone + 1] = id .. '#' .. i end
    redis.call('ZREM', key, unpack(gone))
    n = want
  end
  if n > 0 then
    -- Every slot renewed to the slice's new expiry.
    local args = {}
    for i = 1, n do
      args[2 * i - 1], args[2 * i] = exp, id .. '#' .. i
    end
    if count() + n >= 16 then
      args[#args + 1], args[#args + 2] = '+inf',
        '~ tollgate: a sorted set holding this member stays a skiplist (docs/redis.md) ~'
    end
    redis.call('ZADD', key, unpack(args))
    if redis.call('PTTL', key) < ttl + 60000 then redis.call('PEXPIRE', key, int(ttl + 60000)) end
  end
  v[3] = int(n)
  keep_slice(id, v, n == 0, now, ttl, retention)
  return lease_grant(n, count()), a + @lease_order#
end

-- A budget slice: A[a..]: the `budget_order` layout. Charges what was settled since the last
-- report, keeps at least `keep` reserved, then sets the reservation to the amount wanted (more
-- only in the period containing now). Returns a `budget_grant` or {'gone'}, and the next index.
local function budget_order(A, a, now, divisor, retention)
  local id, key = A[a + @budget_order.slice], A[a + @budget_order.key]
  local limit, unit = tonumber(A[a + @budget_order.limit]), A[a + @budget_order.unit]
  local len_arg, label, pid = A[a + @budget_order.period_len], A[a + @budget_order.label], A[a + @budget_order.period_id]
  local want, keep = tonumber(A[a + @budget_order.amount]), tonumber(A[a + @budget_order.keep])
  local settled = tonumber(A[a + @budget_order.settled])
  local ttl, create = tonumber(A[a + @budget_order.ttl]), A[a + @budget_order.create] == '1'
  local field = label .. '@' .. pid
  local cur_pid, _, pend = period_at(len_arg, now)
  local current = int(cur_pid) == pid
  local committed = function()
    local h = redis.call('HMGET', key, field .. ':s', field .. ':r')
    return tonumber(h[1] or '0') + tonumber(h[2] or '0')
  end
  local v, ended = slice_ticket(id)
  if not v then
    if ended or not create then return {'gone'}, a + @budget_order# end
    if not (current and want > 0 or keep > 0 or settled > 0) then
      return budget_grant(0, committed()), a + @budget_order#
    end
    if current and redis.call('HGET', key, 'cur') ~= field then
      -- A new period, as an admission begins one (see take_budgets).
      local cur = redis.call('HGET', key, 'cur')
      if cur and tonumber(redis.call('HGET', key, cur .. ':r') or '0') <= 0 then
        redis.call('HDEL', key, cur .. ':r', cur .. ':s')
      end
      redis.call('HSET', key, 'cur', field)
    end
    v = {'~B', key, field, unit, '0', '0', len_arg, label}
  end
  local amount, reported = tonumber(v[5]), tonumber(v[6])
  -- Charged in full even beyond the reservation, as a request's settlement is.
  local delta = math.max(settled - reported, 0)
  local taken = math.min(delta, amount)
  if delta > 0 then redis.call('HINCRBY', key, field .. ':s', int(delta)) end
  local change = -taken
  amount = amount - taken
  if amount < keep then
    change, amount = change + keep - amount, keep
  end
  if want > amount and current then
    local grow = math.min(want - amount, share(limit - committed() - change, divisor))
    change, amount = change + grow, amount + grow
  elseif want < amount then
    change, amount = change - (amount - want), want
  end
  -- A scope past its limit (charges beyond reservations) lends nothing it does not need.
  local over = committed() + change - limit
  if over > 0 and amount > keep then
    local trim = math.min(over, amount - keep)
    change, amount = change - trim, amount - trim
  end
  if change ~= 0 then redis.call('HINCRBY', key, field .. ':r', int(change)) end
  if not current and amount == 0 and tonumber(redis.call('HGET', key, field .. ':r') or '0') <= 0 then
    -- An old period with nothing outstanding is dropped, as a request's ending drops it.
    redis.call('HDEL', key, field .. ':r', field .. ':s')
  end
  if current and pend - now < ttl + tonumber(retention) then
    redis.call('PEXPIRE', key, int(math.max(pend - now, ttl) + tonumber(retention)))
  end
  v[5], v[6] = int(amount), int(reported + delta)
  keep_slice(id, v, amount == 0, now, ttl, retention)
  return budget_grant(amount, committed()), a + @budget_order#
end

-- One instance's orders (op 'S'). A[a..]: the `slices` layout, then orders, each its kind ('r'
-- rate, 'l' slots, 'b' budget) and its layout. Returns
-- {'sliced', now, clock, kill switches (target, reason, ...), then one reply per order}.
local function slice_orders(A, a, stop, now, clock, retention)
  -- Keys read or written directly below: what earlier items left pending is written first,
  -- and the later ones read them again.
  flush(true)
  local divisor, kills = math.max(tonumber(A[a + @slices.divisor]), 1), {}
  if A[a + @slices.kills] == '1' then kills = redis.call('HGETALL', PREFIX .. ':kill') end
  local out = {'sliced', now, clock, kills}
  local i = a + @slices#
  while i < stop do
    local kind, reply = A[i], nil
    if kind == 'r' then
      reply, i = rate_order(A, i + 1, now, divisor)
    elseif kind == 'l' then
      reply, i = lease_order(A, i + 1, now, divisor, retention)
    elseif kind == 'b' then
      reply, i = budget_order(A, i + 1, now, divisor, retention)
    else
      error('unknown slice order ' .. tostring(kind))
    end
    out[#out + 1] = reply
  end
  return out
end
