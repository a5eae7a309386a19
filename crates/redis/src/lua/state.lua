-- What a prefix's marker says, and its initialisation (see batch.lua for what the marker
-- and the loss flag mean, seq.lua for the write sequence).
--
-- KEYS: P:marker, P:lost, P:seq.
-- ARGV: 'watch' or 'init', whether the caller has seen the marker (a 'seen' argument, as
--       batch.lua takes it), and the caller's schema (the marker's value).
-- Answers {state, the marker's value or '', the store's epoch or '', its n, why it is lost or
-- ''}; state is, for 'watch': 'kept', 'lost' (written down, as an admission would; a store
-- behind the caller's sequence too) or 'uninitialised'; for 'init': 'initialised' (the marker
-- of a new store written), 'kept' (it was there) or 'lost' (a loss is acknowledged, not
-- initialised over).
-- Touches nothing of the ledger's: no enter.
local function call_state(KEYS, ARGV)
  local marker, lost, seq = KEYS[1], KEYS[2], KEYS[3]
  local found = redis.call('GET', marker)
  if found then
    local epoch, n = seq_read(seq)
    if seq_behind(epoch, n, ARGV[2], marker, lost) then
      return {'lost', '', epoch or '', n, redis.call('GET', lost)}
    end
    if not epoch then
      epoch = seq_epoch()
      redis.call('HSET', seq, 'e', epoch)
    end
    return {'kept', found, epoch, n, ''}
  end
  local why = redis.call('GET', lost)
  if why then return {'lost', '', '', 0, why} end
  if ARGV[1] == 'init' then
    redis.call('SET', marker, ARGV[3])
    local epoch = seq_epoch()
    redis.call('HSET', seq, 'e', epoch, 'n', 0)
    return {'initialised', ARGV[3], epoch, 0, ''}
  end
  if seen_flag(ARGV[2]) == '1' then
    redis.call('SET', lost, 'forgot')
    return {'lost', '', '', 0, 'forgot'}
  end
  return {'uninitialised', '', '', 0, ''}
end
