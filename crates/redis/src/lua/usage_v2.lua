-- Usage of one scope in the period containing now.
--
-- ARGV: prefix, now (0 = Redis TIME), period (-1 = no budget; else as Period::script_arg gives
--       it), period label, retention.
-- KEYS: lease key, budget key.
-- Returns {settled, reserved, leases, carried}.

local function call_usage(KEYS, ARGV)
  enter(ARGV)
  local now, now_str = store_now(ARGV[2])
  sweep(now, now_str, '16', ARGV[5])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local leases = redis.call('ZCOUNT', KEYS[1], '-inf', '(+inf')
  if ARGV[3] == '-1' then return {0, 0, leases} end
  local pid = period_at(ARGV[3], now)
  local field = ARGV[4] .. '@' .. int(pid)
  local h = redis.call('HMGET', KEYS[2], field .. ':s', field .. ':r', field .. ':c')
  return {tonumber(h[1] or '0'), tonumber(h[2] or '0'), leases, tonumber(h[3] or '0')}
end
