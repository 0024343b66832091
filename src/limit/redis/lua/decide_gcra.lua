-- decide_gcra.lua: decide.lua for a request whose limits are all gcra, the common case.
-- Sent as `gcra.lua .. decide_gcra.lua .. lib.lua .. decide.lua`: when every limit is gcra
-- it answers and returns before lib.lua runs, so Redis does not build the library's closures
-- and tables, nor a table per limit, on such a call; otherwise it leaves the call to
-- decide.lua. Same ARGV, KEYS and reply as decide.lua, which documents them, and the same
-- decision: check every limit, commit the ones that admitted only if no enforced limit
-- rejected.

do
  local n = tonumber(ARGV[3]) or 0
  local gcra_only = n > 0 and #KEYS == n
  -- Strides of 7 hold up to the first limit that is not gcra, whose code is read where it is:
  -- a calendar limit's longer arguments (lib.lua) come after its code.
  for i = 0, n - 1 do
    if ARGV[4 + i * 7] ~= '1' then
      gcra_only = false
      break
    end
  end
  if gcra_only then
    local now = clock(ARGV[1])
    local floor_ms = tonumber(ARGV[2]) or 1
    -- Sized for one limit, the usual case: growing a table is an allocation and a copy.
    local out = { 1, now, 0, 0, 0, 0 }
    local tats = { 0 }
    for i = 1, n do
      local b = 3 + (i - 1) * 7
      local count, period, burst = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
      local cost, max_delay = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
      if not (count and period and burst and cost and max_delay) then
        error('tollgate: malformed arguments for limit ' .. i)
      end
      local t, tau = gcra_consts(count, period, burst)
      local admitted, remaining, reset_after, wait, new_tat =
        gcra_check(num(redis.call('GET', KEYS[i])), now, t, tau, cost, burst, max_delay)
      tats[i] = new_tat
      local at = 2 + (i - 1) * 4
      out[at + 1] = admitted
      out[at + 2] = remaining
      out[at + 3] = reset_after
      out[at + 4] = wait
      if admitted == 0 and ARGV[b + 7] ~= '1' then
        out[1] = 0
      end
    end
    if out[1] == 1 then
      for i = 1, n do
        if out[3 + (i - 1) * 4] == 1 then
          gcra_store(KEYS[i], tats[i], now, floor_ms)
        end
      end
    end
    return out
  end
end
