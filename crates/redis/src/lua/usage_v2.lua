-- Usage of one scope in the period containing now.
--
-- ARGV: prefix, now (0 = Redis TIME), period length (-1 = no budget, 0 = month), period label,
--       retention.
-- KEYS: lease key, budget key.
-- Returns {settled, reserved, leases}.

local now, now_str = store_now(ARGV[2])
sweep(now, now_str, '16', ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local leases = redis.call('ZCOUNT', KEYS[1], '-inf', '(+inf')
local len = tonumber(ARGV[3])
if len < 0 then return {0, 0, leases} end
local pid = period_at(len, now)
local field = ARGV[4] .. '@' .. pid
local h = redis.call('HMGET', KEYS[2], field .. ':s', field .. ':r')
return {tonumber(h[1] or '0'), tonumber(h[2] or '0'), leases}
