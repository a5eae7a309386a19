-- Appended to a ledger script (crates/redis/src/lua/common_vN.lua) by bench/lua-cost.sh and run
-- once with EVAL: admissions (and settlements) in a loop inside one script, so that only the
-- ledger's own work is counted, not the network or the batch call around it.
--
-- ARGV: prefix, N, id tag, then the admission's controls: rates (0|1), leases (0|1), budgets
--       (0|1), the mode: 'a' admissions only (leases and tickets pile up, as in the
--       throughput bench's admit rows), 'p' admit + settle with 64 requests in flight, and the
--       items per call B: what a call remembers of its conversions (common's MEMO,
--       PERIODS, ITEMS) is forgotten every B items, as if each B items were one batch call.
-- ARGV[9]: users (default 16), each its own scope; ARGV[10]: requests in flight in mode 'p'
-- (default 64). Every admission is admitted (limits far away) or the script stops with the reply.
local N = tonumber(ARGV[2])
local tag = ARGV[3]
local nr, nl, nb = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local mode = ARGV[7]
local B = tonumber(ARGV[8] or '1')
local U = tonumber(ARGV[9] or '16')
local F = tonumber(ARGV[10] or '64')
local now = 1800000000000
NOW_STR = string.format('%d', now)
local ids, rk, lk, bk = {}, {}, {}, {}
for i = 1, N do ids[i] = tag .. i end
for u = 0, U - 1 do
  rk[u] = PREFIX .. ':r:u' .. u
  lk[u] = PREFIX .. ':l:u' .. u
  bk[u] = PREFIX .. ':b:u' .. u
end
local count = {[0] = '0', '1'}
for i = 1, N do
  if (i - 1) % B == 0 then
    -- A new call: the last one's pending writes are made, and what it read is forgotten.
    flush(true)
    MEMO, PERIODS, ITEMS = nil, nil, 0
  end
  local u = i % U
  local A = {ids[i], '60000', '3600000', '0', count[nr], count[nl], count[nb],
    '0', '0', '0', '0', '0', '0', '0'}
  if V5 then A[#A + 1] = '0'; A[#A + 1] = '0' end
  if nr > 0 then A[#A + 1] = rk[u]; A[#A + 1] = '1000000000'; A[#A + 1] = '60000' end
  if nl > 0 then A[#A + 1] = lk[u]; A[#A + 1] = '1000000' end
  if nb > 0 then
    A[#A + 1] = bk[u]; A[#A + 1] = '1000000000000'; A[#A + 1] = 't'; A[#A + 1] = '86400000'
    A[#A + 1] = 'user'; A[#A + 1] = '200'
  end
  local r = admit_one(A, 1, now, {}, false)
  if r[1] ~= 'admit' then return r end
  if mode == 'p' and i > F then
    r = finish_one({ids[i - F], '3600000', 'settled', '1', '100', '0', '50', '0', '0', '0'}, 1, now)
    if r[1] ~= 'done' then return r end
  end
end
flush(true)
return 'ok'
