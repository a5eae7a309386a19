-- Control 5, concurrency. Twin: crates/core/src/controls/concurrency.rs; a test runs both on the
-- same cases. What a scope holds is read by the caller (lease sets, in the ledger).

-- One more lease in a scope holding `held` of `limit`, the soonest of which expires at `soonest`
-- (nil when none is known). Returns the leases left after it, or nil and the wait to suggest:
-- the soonest expiry still ahead, at most a second.
local function lease_verdict(held, limit, soonest, now)
  if held < limit then return limit - held - 1 end
  local wait = 1000
  if soonest ~= nil and soonest > now then wait = math.min(1000, soonest - now) end
  return nil, wait
end
