-- Renewal: pushes a request's expiry (ticket, leases, index) out by its TTL.
--
-- ARGV: prefix, now (0 = Redis TIME), request id, retention.
-- KEYS: ticket.
-- Returns {'renewed', expires_at} | {'gone'}.

local now = store_now(ARGV[2])
local id, retention = ARGV[3], tonumber(ARGV[4])
sweep(now, 16, retention)
local tkey = PREFIX .. ':t:' .. id
if redis.call('EXISTS', tkey) == 0 then return {'gone'} end
local t = redis.call('HMGET', tkey, 'ttl', 'leases')
local expires = now + tonumber(t[1])
redis.call('HSET', tkey, 'exp', expires)
redis.call('ZADD', PREFIX .. ':x', expires, id)
redis.call('PEXPIRE', tkey, tonumber(t[1]) + retention)
if redis.call('PTTL', PREFIX .. ':x') < tonumber(t[1]) + retention then
  redis.call('PEXPIRE', PREFIX .. ':x', tonumber(t[1]) + retention)
end
for _, lkey in ipairs(split(t[2], '\n')) do
  redis.call('ZADD', lkey, 'XX', expires, id)
  if redis.call('PTTL', lkey) < tonumber(t[1]) + 60000 then redis.call('PEXPIRE', lkey, tonumber(t[1]) + 60000) end
end
return {'renewed', expires}
