-- Renewal: pushes a request's expiry (ticket, leases, index) out by its TTL.
--
-- ARGV: prefix, now (0 = Redis TIME), request id, retention.
-- KEYS: ticket.
-- Returns {'renewed', expires_at} | {'gone'}.

local now = store_now(ARGV[2])
local id, retention = ARGV[3], tonumber(ARGV[4])
sweep(now, 16, retention)
local tkey = PREFIX .. ':tl:' .. id
local t = read_ticket(tkey)
if not t then return {'gone'} end
local expires = now + t.ttl
redis.call('LSET', tkey, 0, expires)
redis.call('PEXPIRE', tkey, t.ttl + retention)
redis.call('ZADD', PREFIX .. ':x', expires, id)
if redis.call('PTTL', PREFIX .. ':x') < t.ttl + retention then
  redis.call('PEXPIRE', PREFIX .. ':x', t.ttl + retention)
end
for _, lkey in ipairs(t.leases) do
  redis.call('ZADD', lkey, 'XX', expires, id)
  if redis.call('PTTL', lkey) < t.ttl + 60000 then redis.call('PEXPIRE', lkey, t.ttl + 60000) end
end
return {'renewed', expires}
