-- What a prefix's marker says, and its initialisation (see batch_v5.lua for what the marker
-- and the loss flag mean).
--
-- KEYS: P:marker, P:lost.
-- ARGV: 'watch' or 'init', whether the caller has seen the marker ('1' | '0'), and the
--       caller's schema (the marker's value).
-- Answers {state, the marker's value or ''}; state is, for 'watch': 'kept', 'lost' (written
-- down, as an admission would) or 'uninitialised'; for 'init': 'initialised' (the marker of a
-- new store written), 'kept' (it was there) or 'lost' (a loss is acknowledged, not initialised
-- over).
-- Touches nothing of the ledger's: no enter.
local function call_state(KEYS, ARGV)
  local marker, lost = KEYS[1], KEYS[2]
  local found = redis.call('GET', marker)
  if found then return {'kept', found} end
  if redis.call('EXISTS', lost) == 1 then return {'lost', ''} end
  if ARGV[1] == 'init' then
    redis.call('SET', marker, ARGV[3])
    return {'initialised', ARGV[3]}
  end
  if ARGV[2] == '1' then
    redis.call('SET', lost, '1')
    return {'lost', ''}
  end
  return {'uninitialised', ''}
end
