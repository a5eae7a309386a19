-- Renewal: pushes a request's expiry (ticket, leases, index) out by its TTL.
-- v4: a request already past its expiry is not renewed but expired here (v3 renewed it when the
-- sweep, 16 tickets per call, had not reached it yet: its lease, no longer counted, came back).
--
-- ARGV: prefix, now (0 = Redis TIME), request id, retention.
-- KEYS: ticket.
-- Returns {'renewed', expires_at} | {'gone'}.

local now, now_str = store_now(ARGV[2])
local id, retention = ARGV[3], tonumber(ARGV[4])
sweep(now, now_str, '16', ARGV[4])
local tkey = PREFIX .. ':ts:' .. id
local t = peek_ticket(tkey)
if not t then return {'gone'} end
if tonumber(t.exp) <= now then
  t = take_ticket(tkey, 'expired', ARGV[4])
  if t then end_ticket(id, t, nil, now) end
  flush()
  return {'gone'}
end
local ttl = tonumber(t.ttl)
local expires = now + ttl
local expires_arg = int(expires)
t.raw[1] = expires_arg
redis.call('SET', tkey, cmsgpack.pack(t.raw), 'PX', int(ttl + retention))
redis.call('ZADD', PREFIX .. ':x', expires_arg, id)
if redis.call('PTTL', PREFIX .. ':x') < ttl + retention then
  redis.call('PEXPIRE', PREFIX .. ':x', int(ttl + retention))
end
for _, lkey in ipairs(t.leases) do
  redis.call('ZADD', lkey, 'XX', expires_arg, id)
  if redis.call('PTTL', lkey) < ttl + 60000 then redis.call('PEXPIRE', lkey, int(ttl + 60000)) end
end
return {'renewed', expires}
