-- What a prefix's marker says, and its initialisation (see batch_v5.lua for what the marker
-- and the loss flag mean).
--
-- KEYS: P:marker, P:lost.
-- ARGV: 'watch' and whether the caller has seen the marker ('1' | '0'): answers 'kept',
--       'lost' (written down, as an admission would) or 'uninitialised';
--       'init': writes the marker of a new store and answers 'initialised', or answers 'kept'
--       (it was there already) or 'lost' (a loss is acknowledged, not initialised over).
local marker, lost = KEYS[1], KEYS[2]
if redis.call('EXISTS', marker) == 1 then return 'kept' end
if redis.call('EXISTS', lost) == 1 then return 'lost' end
if ARGV[1] == 'init' then
  redis.call('SET', marker, '1')
  return 'initialised'
end
if ARGV[2] == '1' then
  redis.call('SET', lost, '1')
  return 'lost'
end
return 'uninitialised'
