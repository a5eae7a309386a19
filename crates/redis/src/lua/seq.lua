-- The store's write sequence, so that a store that went back in time is noticed (a failover to
-- a replica that lagged keeps the marker, replicated long ago, and lacks only the last writes).
-- P:seq holds e, the store's epoch (written when it is initialised or a loss acknowledged, or
-- by the first watch of a store that has none), and n, advanced by every write a script makes
-- (admissions, settlements, slice orders, kill switches, key and limit records).
--
-- A caller's 'seen' argument is its marker flag ('0', '1' or '2', see batch.lua), followed,
-- once it has seen the store's epoch, by ':<epoch>:<the highest n it has seen>'.

-- The flag of a 'seen' argument.
local function seen_flag(seen)
  return string.sub(seen, 1, 1)
end

-- The store's epoch (false when none) and n.
local function seq_read(seq)
  local s = redis.call('HMGET', seq, 'e', 'n')
  return s[1], tonumber(s[2]) or 0
end

-- Whether the store is behind what the caller saw: of the caller's epoch (or of none, when the
-- caller saw one), with a lower n. Then the loss is written down with both numbers and the
-- marker removed, so every caller and every script finds the store lost until its books are
-- rebuilt or an operator acknowledges the loss.
local function seq_behind(epoch, n, seen, marker, lost)
  local theirs, high = string.match(seen, '^%d:([^:]+):(%d+)$')
  if not theirs then return false end
  if epoch and epoch ~= theirs then return false end
  if n >= tonumber(high) then return false end
  redis.call('SET', lost, 'behind ' .. (epoch or 'none') .. ' ' .. n .. ' ' .. high)
  redis.call('DEL', marker)
  return true
end

-- A new epoch: the store's time in microseconds.
local function seq_epoch()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', t[2])
end
