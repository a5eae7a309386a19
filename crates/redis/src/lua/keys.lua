-- Idempotency keys, one hash per key under P:ik:<key>: 'd' the digest of what was sent with it,
-- 'o' the request that claimed it, 'r' its response once answered. The hash's expiry is the
-- claim's in-flight time while unanswered (an instance that dies mid-request lets go of the key
-- then), the keep time once answered.
--
-- KEYS[1]: the key's hash.
-- ARGV 'claim', digest, request id, in-flight ms:
--   {'claimed'} | {'in_flight'} | {'conflict'} | {'answered', response}.
-- ARGV 'end', request id, keep ms[, response]: with a response, kept for keep ms; without, the
--   key is let go. Only the request that claimed it, and only once:
--   {'ended'} | {'not_owner'}.

-- Touches nothing of the ledger's: no enter.
local function call_keys(KEYS, ARGV)
  local k = KEYS[1]
  if ARGV[1] == 'claim' then
    local h = redis.call('HMGET', k, 'd', 'r')
    if not h[1] then
      redis.call('HSET', k, 'd', ARGV[2], 'o', ARGV[3])
      redis.call('PEXPIRE', k, ARGV[4])
      return {'claimed'}
    end
    if h[1] ~= ARGV[2] then return {'conflict'} end
    if not h[2] then return {'in_flight'} end
    return {'answered', h[2]}
  end
  local h = redis.call('HMGET', k, 'o', 'r')
  if h[1] ~= ARGV[2] or h[2] then return {'not_owner'} end
  if ARGV[4] then
    redis.call('HSET', k, 'r', ARGV[4])
    redis.call('PEXPIRE', k, ARGV[3])
  else
    redis.call('DEL', k)
  end
  return {'ended'}
end
