-- Issued keys, one record each in the hash P:keys by id, valued '<version> <record>', beside the
-- hash's change counter '~version' (an instance reads the whole hash again only when it moved).
--
-- KEYS: P:keys, P:marker, P:lost, P:seq. (A record is read with HGET, beside TIME.)
-- ARGV 'put', id, version, record, expected, deadline, step, seen:
--   expected '': written when the held version is lower (a copy of the ledger, the truth);
--   otherwise written when the held version is expected (0: none), a compare-and-set where the
--   store is the truth. A deadline (the store's ms, '' for none) refuses a write that arrives
--   after it, so that a caller whose call timed out learns, once it has passed, that the write
--   never lands. Refused while the store's state is lost: by the loss flag, or by the marker
--   gone when the caller has seen it (seen '1', written down as an admission would), or by a
--   write sequence behind the caller's (seq.lua); seen 'r' (a rebuild, which lifts the loss
--   when it is done) writes regardless. A write advances the sequence.
--   {'done', the store's epoch, its write sequence} | {'changed', held version} | {'late'} |
--   {'lost'}.
-- Touches nothing of the ledger's: no enter.
local function held_version(hash, id)
  local held = redis.call('HGET', hash, id)
  if not held then return 0 end
  return tonumber(string.match(held, '^(%d+) '))
end

local function store_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

local function call_records(KEYS, ARGV)
  local hash, marker, lost, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local seen = ARGV[8]
  if seen ~= 'r' then
    if redis.call('EXISTS', lost) == 1 then return {'lost'} end
    if redis.call('EXISTS', marker) == 0 then
      if seen_flag(seen) == '1' then
        redis.call('SET', lost, 'forgot')
        return {'lost'}
      end
    else
      local epoch, n = seq_read(seq)
      if seq_behind(epoch, n, seen, marker, lost) then return {'lost'} end
    end
  end
  if ARGV[6] ~= '' and store_ms() > tonumber(ARGV[6]) then return {'late'} end
  local v = held_version(hash, ARGV[2])
  local want = tonumber(ARGV[3])
  if ARGV[5] == '' then
    if v >= want then return {'changed', tostring(v)} end
  elseif v ~= tonumber(ARGV[5]) then
    return {'changed', tostring(v)}
  end
  redis.call('HSET', hash, ARGV[2], ARGV[3] .. ' ' .. ARGV[4])
  redis.call('HINCRBY', hash, '~version', ARGV[7])
  local n = redis.call('HINCRBY', seq, 'n', 1)
  return {'done', redis.call('HGET', seq, 'e') or '', n}
end
