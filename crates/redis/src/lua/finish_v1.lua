-- Settlement or release of one request. Idempotent: a second call answers how it ended.
--
-- ARGV: prefix, now (0 = Redis TIME), request id, retention, ending (settled|released),
--       usage "in,cached,out" or "" (release without usage: the ticket's expired usage).
-- KEYS: ticket, finished.
-- Returns {'done', charges...} | {'ended', ending} | {'unknown'}.

local now = store_now(ARGV[2])
local id, retention, ending = ARGV[3], tonumber(ARGV[4]), ARGV[5]
sweep(now, 16, retention)
local tkey = PREFIX .. ':t:' .. id
if redis.call('EXISTS', tkey) == 1 then
  local usage = nil
  if ARGV[6] ~= '' then usage = nums(ARGV[6]) end
  local charged = end_ticket(tkey, id, usage, ending, retention, now)
  local out = {'done'}
  for _, c in ipairs(charged) do out[#out + 1] = c end
  return out
end
local how = redis.call('GET', PREFIX .. ':f:' .. id)
if how then return {'ended', how} end
return {'unknown'}
