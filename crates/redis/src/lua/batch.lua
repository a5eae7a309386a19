-- Admissions and settlements of many requests in one call: each item is the same atomic
-- transition as on its own, applied in order; the call as a whole is atomic too.
--
-- ARGV: prefix, now (0 = Redis TIME), retention, whether the caller has seen the store's
--       marker ('1'), or not yet ('0'), or not yet and the prefix is new by its word ('2':
--       a scratch prefix, whose marker is written here), with the write sequence it has seen
--       (seq.lua), then per item: op ('a' admit | 's' admit with a shadow
--       plan | 'f' finish | 'p' probe, an admission that takes nothing | 'u' undo an
--       admission | 'S' an instance's slice orders), the number of its arguments, its
--       arguments (see admit_one, admit_shadowed, finish_one, undo_one and slice_orders).
-- KEYS: every key the items touch (for cluster routing; all share the prefix's slot).
-- Returns one reply per item, in order, then the store's write sequence {epoch, n, why the
-- store is lost or ''} (see seq.lua); an item that fails answers {'error', message} and the others still run. While the store's state is lost, every admission answers {'lost'}; while
-- it is not initialised, {'uninitialised'}.

-- The marker (no expiry) says the store still holds what it was given. A caller that has seen
-- it and finds it gone knows the store forgot (a restart without persistence, FLUSHALL,
-- eviction, a failover to a lagging replica), and so does every caller after it: the loss is
-- written down (`lost`, no expiry) until an operator acknowledges it. A store with neither is
-- new, or forgot while no one watched: no marker is written here unless the caller says the
-- prefix is new (a marker over a loss would hide it), and admissions answer {'uninitialised'}
-- until the store is initialised from outside (state.lua).
local function store_state(seen)
  local marker, lost = PREFIX .. ':marker', PREFIX .. ':lost'
  if redis.call('EXISTS', marker) == 1 then
    local epoch, n = seq_read(PREFIX .. ':seq')
    if seq_behind(epoch, n, seen, marker, lost) then return 'lost', epoch, n end
    return 'kept', epoch, n
  end
  local flag = seen_flag(seen)
  if flag == '1' or redis.call('EXISTS', lost) == 1 then
    if redis.call('EXISTS', lost) == 0 then redis.call('SET', lost, 'forgot') end
    return 'lost', false, 0
  end
  if flag == '2' then
    redis.call('SET', marker, SCHEMA)
    redis.call('HSET', PREFIX .. ':seq', 'e', seq_epoch(), 'n', 0)
    return 'kept', false, 0
  end
  return 'uninitialised', false, 0
end

local function call_batch(KEYS, ARGV)
  enter(ARGV)
  local now, now_str = store_now(ARGV[2])
  sweep(now, now_str, '16', ARGV[3])
  local state, epoch, n = store_state(ARGV[4])
  local wrote = false
  local kills = nil
  local out = {}
  local a, longest = 5, 0
  while a <= #ARGV do
    local op, n = ARGV[a], 0 + ARGV[a + 1]
    local ok, reply
    wrote = wrote or op ~= 'p'
    if (op == 'a' or op == 'p' or op == 's' or op == 'S') and state ~= 'kept' then
      if state == 'lost' then ok, reply = true, {'lost'} else ok, reply = true, {'uninitialised'} end
    elseif op == 'S' then
      ok, reply = pcall(slice_orders, ARGV, a + 2, a + 2 + n, now, CLOCK_NOW, ARGV[3])
    elseif op == 'a' or op == 'p' then
      if kills == nil then kills = kill_table() end
      ok, reply = pcall(admit_one, ARGV, a + 2, now, kills, op == 'p')
      -- The request's TTL, from its expiry: its argument is not converted again.
      if ok and op == 'a' and reply[@admitted.kind + 1] == 'admit' then
        longest = math.max(longest, reply[@admitted.expires_at + 1] - now)
      end
    elseif op == 's' then
      if kills == nil then kills = kill_table() end
      ok, reply = pcall(admit_shadowed, ARGV, a + 2, now, kills)
      if ok and reply[1] == 'shadowed' and reply[2][@admitted.kind + 1] == 'admit' then
        longest = math.max(longest, reply[2][@admitted.expires_at + 1] - now)
      end
    elseif op == 'u' then
      ok, reply = pcall(undo_one, ARGV, a + 2)
    else
      ok, reply = pcall(finish_one, ARGV, a + 2, now)
    end
    if ok then out[#out + 1] = reply else out[#out + 1] = {'error', tostring(reply)} end
    a = a + 2 + n
  end
  -- Each key the items touched is written once (see the write-back state in common.lua).
  flush()
  -- The write sequence, after the items: the store's epoch and n, advanced when anything was
  -- written to a store that holds its books.
  if state == 'kept' and wrote then n = redis.call('HINCRBY', PREFIX .. ':seq', 'n', 1) end
  local why = ''
  if state == 'lost' then why = redis.call('GET', PREFIX .. ':lost') or '' end
  out[#out + 1] = {epoch or '', n, why}
  if longest > 0 then
    -- Garbage collection for abandoned prefixes only: any call on the prefix sweeps expired
    -- tickets long before this runs out.
    redis.call('PEXPIRE', PREFIX .. ':x', math.max(longest + ARGV[3], 604800000))
  end
  return out
end
