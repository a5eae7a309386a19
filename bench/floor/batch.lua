-- bench/floor.sh: the fewest commands B admissions need in one call, each of its own user (16
-- users, as in the throughput bench), with a rate, a concurrency and a budget limit and almost no
-- Lua logic: fewer commands than one.lua per admission (no clean-up of expired leases; the time,
-- the sweep and the expiry index once per call). It decides nothing and is not the ledger.
-- ARGV: B, request id tag.
local B, tag = tonumber(ARGV[1]), ARGV[2]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZRANGEBYSCORE', 'fb:x', '-inf', now, 'LIMIT', 0, 16)
local idx = {}
for i = 1, B do
  local u = 'fb:u' .. (i % 16)
  local id = tag .. ':' .. i
  redis.call('HMGET', u .. ':r', 's', 'c', 'p')
  redis.call('HINCRBY', u .. ':r', 'c', 1)
  redis.call('ZCARD', u .. ':l')
  redis.call('ZADD', u .. ':l', now + 60000, id)
  redis.call('HMGET', u .. ':b', 'd@1:s', 'd@1:r')
  redis.call('HINCRBY', u .. ':b', 'd@1:r', 200)
  redis.call('SET', 'fb:ts:' .. id, 'P:r:u|P:l:u|P:b:u|d@1|200|100|0|100', 'PX', 3660000)
  idx[#idx + 1] = now + 60000
  idx[#idx + 1] = id
end
redis.call('ZADD', 'fb:x', unpack(idx))
return B
