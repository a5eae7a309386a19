-- Slices (tollgate_core::slices): an instance's orders for what it holds of hot scopes, in one
-- item of a batch call (op 'S'). Prepended with common_v7.lua; rare next to admissions, so its
-- steps read and write keys directly, after writing what the call's earlier items left pending.
-- Every order but a rate take names totals, not changes, so that one sent again after a lost
-- answer does nothing twice. Mirrors crates/core/src/memory/slices.rs. Reply kinds:
-- SLICE_REPLIES.

-- What one grant may take of `free`: free / divisor, at least 1 while anything is free.
local function share(free, divisor)
  if free <= 0 then return 0 end
  return math.max(1, math.floor(free / divisor))
end

-- Rate: A[a..]: key, limit, window, take, back, back_start. Gives back `back` attempts counted
-- ahead in the window that started at back_start (or in it as the previous window), then counts
-- up to `take` more ahead. Returns {granted, start, current, previous} and the next index.
local function rate_order(A, a, now, divisor)
  local key, limit, window_arg = A[a], tonumber(A[a + 1]), A[a + 2]
  local window, take, back, back_start =
    tonumber(window_arg), tonumber(A[a + 3]), tonumber(A[a + 4]), tonumber(A[a + 5])
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
  return {granted, w[1], w[2], w[3]}, a + 6
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

-- Slots: A[a..]: slice id, key, limit, slots wanted, ttl, create (0/1). Returns {slots, held}
-- or {'gone'}, and the next index.
local function lease_order(A, a, now, divisor, retention)
  local id, key, limit, want = A[a], A[a + 1], tonumber(A[a + 2]), tonumber(A[a + 3])
  local ttl, create = tonumber(A[a + 4]), A[a + 5] == '1'
  local v, ended = slice_ticket(id)
  local count = function() return redis.call('ZCOUNT', key, '-inf', '(+inf') end
  if not v then
    if ended or not create then return {'gone'}, a + 6 end
    if want == 0 then return {0, count()}, a + 6 end
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
  return {n, count()}, a + 6
end

-- A budget slice: A[a..]: slice id, key, limit, unit, period length, label, period id, amount
-- wanted, keep, settled in all, ttl, create (0/1). Charges what was settled since the last
-- report, keeps at least `keep` reserved, then sets the reservation to the amount wanted (more
-- only in the period containing now). Returns {amount, committed} or {'gone'}, and the next
-- index.
local function budget_order(A, a, now, divisor, retention)
  local id, key, limit, unit = A[a], A[a + 1], tonumber(A[a + 2]), A[a + 3]
  local len, label, pid = tonumber(A[a + 4]), A[a + 5], A[a + 6]
  local want, keep, settled = tonumber(A[a + 7]), tonumber(A[a + 8]), tonumber(A[a + 9])
  local ttl, create = tonumber(A[a + 10]), A[a + 11] == '1'
  local field = label .. '@' .. pid
  local cur_pid, _, pend = period_at(len, now)
  local current = int(cur_pid) == pid
  local committed = function()
    local h = redis.call('HMGET', key, field .. ':s', field .. ':r')
    return tonumber(h[1] or '0') + tonumber(h[2] or '0')
  end
  local v, ended = slice_ticket(id)
  if not v then
    if ended or not create then return {'gone'}, a + 12 end
    if not (current and want > 0 or keep > 0 or settled > 0) then
      return {0, committed()}, a + 12
    end
    if current and redis.call('HGET', key, 'cur') ~= field then
      -- A new period, as an admission begins one (see take_budgets).
      local cur = redis.call('HGET', key, 'cur')
      if cur and tonumber(redis.call('HGET', key, cur .. ':r') or '0') <= 0 then
        redis.call('HDEL', key, cur .. ':r', cur .. ':s')
      end
      redis.call('HSET', key, 'cur', field)
    end
    v = {'~B', key, field, unit, '0', '0', A[a + 4], label}
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
  return {amount, committed()}, a + 12
end

-- One instance's orders (op 'S'). A[a..]: divisor, whether to answer the kill switches (0/1),
-- then orders, each its kind ('r' rate, 'l' slots, 'b' budget) and its arguments. Returns
-- {'sliced', now, clock, kill switches (target, reason, ...), then one reply per order}.
local function slice_orders(A, a, stop, now, clock, retention)
  -- Keys read or written directly below: what earlier items left pending is written first,
  -- and the later ones read them again.
  flush(true)
  local divisor, kills = math.max(tonumber(A[a]), 1), {}
  if A[a + 1] == '1' then kills = redis.call('HGETALL', PREFIX .. ':kill') end
  local out = {'sliced', now, clock, kills}
  local i = a + 2
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
