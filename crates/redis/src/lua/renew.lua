-- Renewal: pushes a request's expiry (ticket, leases, index) out by its TTL.
-- v4: a request already past its expiry is not renewed but expired here (v3 renewed it when the
-- sweep, 16 tickets per call, had not reached it yet: its lease, no longer counted, came back).
--
-- ARGV: prefix, now (0 = Redis TIME), request id, retention.
-- KEYS: ticket.
-- Returns {'renewed', expires_at} | {'gone'}.

local function call_renew(KEYS, ARGV)
  enter(ARGV)
  local now, now_str = store_now(ARGV[2])
  local id, retention = ARGV[3], tonumber(ARGV[4])
  sweep(now, now_str, '16', ARGV[4])
  local tkey = PREFIX .. ':ts:' .. id
  local v = peek_ticket(tkey)
  if not v then return {'gone'} end
  if tonumber(v[1]) <= now then
    v = take_ticket(tkey, 'expired', ARGV[4])
    if v then end_ticket(id, v, now) end
    flush()
    return {'gone'}
  end
  local ttl = tonumber(v[2])
  local expires = now + ttl
  local expires_arg = int(expires)
  v[1] = expires_arg
  redis.call('SET', tkey, cmsgpack.pack(v), 'PX', int(ttl + retention))
  redis.call('ZADD', PREFIX .. ':x', expires_arg, id)
  if redis.call('PTTL', PREFIX .. ':x') < ttl + retention then
    redis.call('PEXPIRE', PREFIX .. ':x', int(ttl + retention))
  end
  for i = 10, 9 + tonumber(v[9]) do
    local lkey = v[i]
    redis.call('ZADD', lkey, 'XX', expires_arg, id)
    if redis.call('PTTL', lkey) < ttl + 60000 then redis.call('PEXPIRE', lkey, int(ttl + 60000)) end
  end
  local r = {}
  r[@renewed.kind + 1], r[@renewed.expires_at + 1] = 'renewed', expires
  return r
end
