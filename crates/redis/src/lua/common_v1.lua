-- Tollgate ledger, shared by every script (prepended to each). Integer arithmetic only; every
-- function mirrors crates/core/src/ledger.rs. Numbers stay below 2^53 by the policy's bounds.

local WEIGHT_SCALE = 10000
local COUNT_CAP = 2147483648
local DAY_MS = 86400000
local PREFIX = ARGV[1]

local function floor_div(a, b) return math.floor(a / b) end

-- The store's time: the caller's (tests drive a manual clock) or Redis TIME, never earlier than
-- any time this store has used before.
local function store_now(override)
  local now = tonumber(override)
  if now == nil or now == 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + floor_div(tonumber(t[2]), 1000)
  end
  local key = PREFIX .. ':clock'
  -- One round inside Redis: write now and read what was there; put it back if it was later.
  local last = tonumber(redis.call('SET', key, now, 'PX', 2592000000, 'GET') or '0')
  if now < last then
    now = last
    redis.call('SET', key, now, 'PX', 2592000000)
  end
  return now
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

-- (id, start, end) of the period containing now; len 0 means calendar month.
local function period_at(len, now)
  if len > 0 then
    local id = floor_div(now, len)
    return id, id * len, (id + 1) * len
  end
  local y, m = civil_from_days(floor_div(now, DAY_MS))
  local start = days_from_civil(y, m, 1) * DAY_MS
  local ny, nm = y, m + 1
  if m == 12 then ny, nm = y + 1, 1 end
  return y * 12 + (m - 1), start, days_from_civil(ny, nm, 1) * DAY_MS
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

local function split(s, sep)
  local out = {}
  if s == nil or s == '' then return out end
  for part in string.gmatch(s, '([^' .. sep .. ']+)') do out[#out + 1] = part end
  return out
end

local function nums(s)
  local out = {}
  for i, v in ipairs(split(s, ',')) do out[i] = tonumber(v) end
  return out
end

-- Ends a ticket: leases back, each reservation replaced by the charge for the usage
-- {input, cached, output} (nil: the ticket's expired usage). Returns the charges.
local function end_ticket(tkey, id, usage, ending, retention, now)
  local t = redis.call('HMGET', tkey, 'leases', 'budgets', 'price', 'xu')
  for _, lkey in ipairs(split(t[1], '\n')) do redis.call('ZREM', lkey, id) end
  local price = nums(t[3])
  if usage == nil then usage = nums(t[4]) end
  local charged = {}
  for _, b in ipairs(split(t[2], '\n')) do
    local f = split(b, '\t')
    local bkey, field, unit, amount = f[1], f[2], f[3], tonumber(f[4])
    local charge
    if unit == 't' then charge = usage[1] + usage[3] else charge = cost(price, usage[1], usage[2], usage[3]) end
    redis.call('HINCRBY', bkey, field .. ':r', -amount)
    redis.call('HINCRBY', bkey, field .. ':s', charge)
    local left = redis.call('HINCRBY', bkey, field .. ':n', -1)
    local cur = redis.call('HGET', bkey, 'cur')
    if left <= 0 and cur ~= field then
      -- An old period with nothing outstanding: nothing reads it any more.
      redis.call('HDEL', bkey, field .. ':r', field .. ':s', field .. ':n')
    end
    charged[#charged + 1] = charge
  end
  redis.call('DEL', tkey)
  redis.call('ZREM', PREFIX .. ':x', id)
  redis.call('SET', PREFIX .. ':f:' .. id, ending, 'PX', retention)
  return charged
end

-- Expires up to `max` tickets whose time has come.
local function sweep(now, max, retention)
  local ids = redis.call('ZRANGEBYSCORE', PREFIX .. ':x', '-inf', now, 'LIMIT', 0, max)
  for _, id in ipairs(ids) do
    end_ticket(PREFIX .. ':t:' .. id, id, nil, 'expired', retention, now)
  end
end
