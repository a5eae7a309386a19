-- Expires up to ARGV[4] tickets whose time has come (maintenance; every other call sweeps 16).
--
-- ARGV: prefix, now (0 = Redis TIME), retention, max.
-- KEYS: the expiry index.
-- Returns the number of tickets expired.

local function call_sweep(KEYS, ARGV)
  enter(ARGV)
  local now, now_str = store_now(ARGV[2])
  local before = redis.call('ZCOUNT', PREFIX .. ':x', '-inf', now)
  sweep(now, now_str, ARGV[4], ARGV[3])
  return before - redis.call('ZCOUNT', PREFIX .. ':x', '-inf', now)
end
