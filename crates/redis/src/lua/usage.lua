-- Usage of one scope in the period containing now.
--
-- ARGV: prefix, now (0 = Redis TIME), period (-1 = no budget; else as Period::script_arg gives
--       it), period label, retention, the carry-over's cap and the budget's limit (a cap of 0:
--       none; else a period no admission has started shows what its first will carry over).
-- KEYS: lease key, budget key.
-- Returns {settled, reserved, leases, carried, the store's time}.

local function call_usage(KEYS, ARGV)
  enter(ARGV)
  local now, now_str = store_now(ARGV[2])
  sweep(now, now_str, '16', ARGV[5])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local leases = redis.call('ZCOUNT', KEYS[1], '-inf', '(+inf')
  if ARGV[3] == '-1' then return {0, 0, leases, 0, now} end
  local pid, pstart = period_at(ARGV[3], now)
  local field = ARGV[4] .. '@' .. int(pid)
  local h = redis.call('HMGET', KEYS[2], field .. ':s', field .. ':r', field .. ':c', 'cur')
  local carry, cap = tonumber(h[3] or '0'), tonumber(ARGV[6] or '0')
  if cap > 0 and h[4] ~= field then
    -- A period no admission has started: what its first will carry over (as budget_at).
    local before = ARGV[4] .. '@' .. int(period_at(ARGV[3], pstart - 1))
    if h[4] == before then
      local b = redis.call('HMGET', KEYS[2], before .. ':s', before .. ':r', before .. ':c')
      carry = carried(cap, tonumber(ARGV[7]), 0 + (b[3] or 0), (b[1] or 0) + (b[2] or 0))
    end
  end
  return {tonumber(h[1] or '0'), tonumber(h[2] or '0'), leases, carry, now}
end
