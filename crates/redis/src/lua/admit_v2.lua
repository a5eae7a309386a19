-- Admission: count the attempt in every rate scope, apply the token verdict, take a lease in
-- every concurrency scope and reserve in every budget scope, all or nothing.
--
-- ARGV: prefix, now (0 = Redis TIME), request id, ttl, retention, token_deny (0/1), n_rate,
--       n_lease, n_budget, price "in,cached,out", expired usage "in,cached,out", n_kill, the
--       kill-switch targets, then per rate scope: key, limit, window; per lease scope: key, limit;
--       per budget scope: key, limit, unit (t|m), period length (0 = month), period label, amount.
-- KEYS: every key touched: ticket, finished, then the scopes' keys in ARGV order.
-- Returns {'admit', expires_at, quota values...} | {'deny', reason, scope index, remaining,
--         retry_after (-1 none), reset (-1 none)} | {'token'} | {'dup'} | {'killed', target, reason}.
-- v2: the kill switch (P:kill), checked before anything is counted.

local now = store_now(ARGV[2])
local id, ttl, retention = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local token_deny = ARGV[6] == '1'
local n_rate, n_lease, n_budget = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
sweep(now, 16, retention)

local n_kill = tonumber(ARGV[12])
if n_kill > 0 then
  local targets = {}
  for i = 1, n_kill do targets[i] = ARGV[12 + i] end
  local reasons = redis.call('HMGET', PREFIX .. ':kill', unpack(targets))
  for i = 1, n_kill do
    if reasons[i] then return {'killed', targets[i], reasons[i]} end
  end
end

local tkey = PREFIX .. ':t:' .. id
if redis.call('EXISTS', tkey, PREFIX .. ':f:' .. id) > 0 then
  return {'dup'}
end

local quotas = {}
local a = 13 + n_kill
-- 1. Rate: every attempt counts in every rate scope.
local rate_fail = nil
for i = 1, n_rate do
  local key, limit, window = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local h = redis.call('HMGET', key, 's', 'c', 'p', 'w')
  local w = {tonumber(h[1] or '0'), tonumber(h[2] or '0'), tonumber(h[3] or '0')}
  if tonumber(h[4] or window) ~= window then w = {0, 0, 0} end
  local old_start = h[1] and tonumber(h[1]) or -1
  roll(w, now, window)
  w[2] = math.min(w[2] + 1, COUNT_CAP)
  local count = scaled(w, now, window)
  redis.call('HSET', key, 's', w[1], 'c', w[2], 'p', w[3], 'w', window)
  -- Set when a window starts: it then covers this window and the next, as long as it matters.
  if w[1] ~= old_start then redis.call('PEXPIRE', key, 2 * window + 1000) end
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
local lease_keys = {}
for i = 1, n_lease do
  local key, limit = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  -- Unexpired leases only; expired members are removed by the sweep and by settlement.
  local held = redis.call('ZCOUNT', key, '(' .. now, '+inf')
  if held >= limit then
    local soonest = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local wait = 1000
    if soonest[2] ~= nil then wait = math.max(1, math.min(1000, tonumber(soonest[2]) - now)) end
    return {'deny', 4, i - 1, 0, wait, -1}
  end
  lease_keys[#lease_keys + 1] = key
  quotas[#quotas + 1] = limit - held - 1
end
-- 6. Budget: check all, then reserve all.
local budgets = {}
for i = 1, n_budget do
  local key, limit, unit, len, label, amount =
    ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4], tonumber(ARGV[a + 5])
  a = a + 6
  local pid, _, pend = period_at(len, now)
  local field = label .. '@' .. pid
  local h = redis.call('HMGET', key, field .. ':s', field .. ':r', 'cur')
  local committed = tonumber(h[1] or '0') + tonumber(h[2] or '0')
  if committed + amount > limit then
    local retry = -1
    if amount <= limit then retry = pend - now end
    return {'deny', 5, i - 1, math.max(limit - committed, 0), retry, pend - now}
  end
  budgets[#budgets + 1] = {key, field, unit, amount, pend, h[3]}
  quotas[#quotas + 1] = limit - committed - amount
  quotas[#quotas + 1] = pend - now
end
-- Everything passed: take the leases, make the reservations, record the ticket.
local expires = now + ttl
for _, key in ipairs(lease_keys) do
  redis.call('ZADD', key, expires, id)
  redis.call('PEXPIRE', key, ttl + 60000)
end
local lines = {}
for _, b in ipairs(budgets) do
  local key, field, cur = b[1], b[2], b[6]
  if cur ~= field then
    -- A new period: drop the previous one unless reservations still settle into it.
    if cur and tonumber(redis.call('HGET', key, cur .. ':n') or '0') <= 0 then
      redis.call('HDEL', key, cur .. ':r', cur .. ':s', cur .. ':n')
    end
    redis.call('HSET', key, 'cur', field)
  end
  redis.call('HINCRBY', key, field .. ':r', b[4])
  redis.call('HINCRBY', key, field .. ':n', 1)
  -- Kept through the period, and while any reservation in it may still settle: set when the
  -- period starts, and again only for a reservation that outlives the period.
  if cur ~= field or ttl > b[5] - now then
    redis.call('PEXPIRE', key, math.max(b[5] - now, ttl) + retention)
  end
  lines[#lines + 1] = key .. '\t' .. field .. '\t' .. b[3] .. '\t' .. b[4]
end
redis.call('HSET', tkey, 'exp', expires, 'ttl', ttl, 'leases', table.concat(lease_keys, '\n'),
  'budgets', table.concat(lines, '\n'), 'price', ARGV[10], 'xu', ARGV[11])
redis.call('ZADD', PREFIX .. ':x', expires, id)
-- Garbage collection for abandoned prefixes only: any call on the prefix sweeps expired tickets
-- long before these run out.
redis.call('PEXPIRE', tkey, ttl + retention)
redis.call('PEXPIRE', PREFIX .. ':x', math.max(ttl + retention, 604800000))
local out = {'admit', expires}
for _, q in ipairs(quotas) do out[#out + 1] = q end
return out
