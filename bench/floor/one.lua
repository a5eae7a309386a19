-- bench/floor.sh: the fewest commands one admission with a rate, a concurrency and a budget limit
-- needs under the Redis store's design, with almost no Lua logic. An experiment to bound what any
-- script of that design can reach; it decides nothing and is not the ledger.
-- KEYS: expiry index, ticket, rate window, lease set, budget. ARGV: request id.
local id = ARGV[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 16)
redis.call('HMGET', KEYS[3], 's', 'c', 'p')
redis.call('HINCRBY', KEYS[3], 'c', 1)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZCARD', KEYS[4])
redis.call('ZADD', KEYS[4], now + 60000, id)
redis.call('HMGET', KEYS[5], 'd@1:s', 'd@1:r')
redis.call('HINCRBY', KEYS[5], 'd@1:r', 200)
redis.call('SET', KEYS[2], 'P:r:u|P:l:u|P:b:u|d@1|200|100|0|100', 'PX', 3660000)
redis.call('ZADD', KEYS[1], now + 60000, id)
return {'admit', now + 60000, 999, 60000, 999, 999, 86400000}
