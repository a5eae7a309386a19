-- Control 1, the request rate, and the repeats of loop detection, which are counted the same
-- way. Twin: crates/core/src/controls/rate.rs (with RateWindow in crates/core/src/ledger.rs);
-- a test runs both on the same cases.
--
-- Sliding window: {start, current, previous} rolled to now.
local function roll(w, now, window)
  local start = now - (now % window)
  if start <= w[1] then return end
  if start - w[1] == window then w[3] = w[2] else w[3] = 0 end
  w[2] = 0
  w[1] = start
end

local function weight_at(w, t, window)
  local elapsed = t - w[1]
  if elapsed < 0 then elapsed = 0 end
  if elapsed > window then elapsed = window end
  return math.floor((window - elapsed) * 10000 / window)
end

local function scaled(w, t, window)
  return w[3] * weight_at(w, t, window) + w[2] * 10000
end

local function retry_after(w, now, window, limit)
  local function admits(t)
    local c = {w[1], w[2], w[3]}
    roll(c, t, window)
    return math.min(c[2] + 1, 2147483648) * 10000 + c[3] * weight_at(c, t, window) <= limit * 10000
  end
  if admits(now) then return 0 end
  local lo, hi = now, math.max(w[1] + 2 * window, now + 1)
  while lo + 1 < hi do
    local mid = lo + math.floor((hi - lo) / 2)
    if admits(mid) then hi = mid else lo = mid end
  end
  return hi - now
end

-- Counts one attempt at now in the window w (rolled to now first). Returns whether it took the
-- scope over its limit, the attempts left after it, the time until the fixed window ends, and
-- (over the limit) how long until one more attempt would pass, else 0.
local function rate_count(w, now, window, limit)
  roll(w, now, window)
  w[2] = math.min(w[2] + 1, 2147483648)
  local count = scaled(w, now, window)
  local over, retry = count > limit * 10000, 0
  if over then retry = retry_after(w, now, window, limit) end
  return over, math.max(limit - math.ceil(count / 10000), 0), w[1] + window - now, retry
end

-- What the window w has left at now, read, not counted (twin: rate::peek): the attempts left
-- and the time until the fixed window ends. Rolls a copy only (of numbers or their strings).
local function rate_peek(w, now, window, limit)
  local c = {0 + (w[1] or 0), 0 + (w[2] or 0), 0 + (w[3] or 0)}
  roll(c, now, window)
  local count = scaled(c, now, window)
  return math.max(limit - math.ceil(count / 10000), 0), c[1] + window - now
end
