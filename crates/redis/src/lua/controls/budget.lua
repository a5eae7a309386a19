-- Control 6, the budget, and the tool-call budget, which is checked the same way. Twin:
-- crates/core/src/controls/budget.rs (with Period::at in crates/core/src/ledger.rs); a test
-- runs both on the same cases. What a scope has committed is read by the caller (budget
-- cells, in the ledger).

-- A day number (days since 1970-01-01) as year, month, day, and back (proleptic Gregorian).
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- (id, start, end) of the period containing now, as Period::at in crates/core/src/ledger.rs.
-- `arg` is what Period::script_arg gives: a length in ms, 0 for a calendar month (UTC), or a
-- calendar period in a zone as the starts around the caller's instant,
-- 'before,start,end,after', of which the period containing now is taken (the nearest at
-- either side when now is outside them: a clock a whole period away from the caller's). Its
-- id is its start.
local function period_of(arg, now)
  local id, start, stop
  if type(arg) == 'string' and string.find(arg, ',', 1, true) then
    local b = {}
    for x in string.gmatch(arg, '[^,]+') do b[#b + 1] = tonumber(x) end
    if now < b[2] then return b[1], b[1], b[2] end
    if now >= b[3] then return b[3], b[3], b[4] end
    return b[2], b[2], b[3]
  end
  -- By arithmetic, not tonumber (see num in common.lua).
  local len = 0 + arg
  if len > 0 then
    id = math.floor(now / len)
    start, stop = id * len, (id + 1) * len
  else
    -- A calendar month (UTC).
    local y, m = civil_from_days(math.floor(now / 86400000))
    local ny, nm = y, m + 1
    if m == 12 then ny, nm = y + 1, 1 end
    id, start, stop = y * 12 + (m - 1), days_from_civil(y, m, 1) * 86400000,
      days_from_civil(ny, nm, 1) * 86400000
  end
  return id, start, stop
end

-- What a period adds to `limit` of what the one just before left unused, at most `cap`: that
-- period's limit (its own carry included) less what it settled and reserved. As
-- budget::carried in crates/core/src/controls/budget.rs.
local function carried(cap, limit, carry, committed)
  if cap <= 0 then return 0 end
  return math.min(math.max(limit + carry - committed, 0), cap)
end

-- A reservation of `amount` in a scope that has `committed` (settled + reserved) of `limit` in
-- the period ending at pend. Returns true and what is left after it, or false, what is left,
-- and the wait to suggest: until the period ends, or -1 (none) for an amount over the whole
-- limit, which no reset admits.
local function budget_verdict(committed, amount, limit, pend, now)
  if committed + amount > limit then
    local retry = -1
    if amount <= limit then retry = pend - now end
    return false, math.max(limit - committed, 0), retry
  end
  return true, limit - committed - amount
end
