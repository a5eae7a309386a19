-- Admissions and settlements of many requests in one call: each item is the same atomic
-- transition as on its own, applied in order; the call as a whole is atomic too.
--
-- ARGV: prefix, now (0 = Redis TIME), retention, then per item: op ('a' admit | 'f' finish |
--       'p' probe, an admission that takes nothing | 'u' undo an admission), the number of its
--       arguments, its arguments (see admit_one, finish_one and undo_one).
-- KEYS: every key the items touch (for cluster routing; all share the prefix's slot).
-- Returns one reply per item, in order; an item that fails answers {'error', message} and the
-- others still run.

local now, now_str = store_now(ARGV[2])
sweep(now, now_str, '16', ARGV[3])
local kills = nil
local out = {}
local a, longest = 4, 0
while a <= #ARGV do
  local op, n = ARGV[a], 0 + ARGV[a + 1]
  local ok, reply
  if op == 'a' or op == 'p' then
    if kills == nil then kills = kill_table() end
    ok, reply = pcall(admit_one, ARGV, a + 2, now, kills, op == 'p')
    if ok and op == 'a' and reply[1] == 'admit' then longest = math.max(longest, 0 + ARGV[a + 3]) end
  elseif op == 'u' then
    ok, reply = pcall(undo_one, ARGV, a + 2)
  else
    ok, reply = pcall(finish_one, ARGV, a + 2, now)
  end
  if ok then out[#out + 1] = reply else out[#out + 1] = {'error', tostring(reply)} end
  a = a + 2 + n
end
-- Each key the items touched is written once (see the write-back state in common_v3.lua).
flush()
if longest > 0 then
  -- Garbage collection for abandoned prefixes only: any call on the prefix sweeps expired
  -- tickets long before this runs out.
  redis.call('PEXPIRE', PREFIX .. ':x', math.max(longest + tonumber(ARGV[3]), 604800000))
end
return out
