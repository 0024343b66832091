-- reserve.lua: a reservation (`reserve_ahead`) on one gcra key: at least `cost` units and up
-- to `want`, as many as fit now, taken at once for one instance to spend in process. Sent as
-- `gcra.lua .. reserve.lua`. Mirrors `Gcra::grant` (src/limit/algorithm/gcra.rs): a decision
-- of `cost` (its rejection is the answer when it does not fit), then as many more units as its
-- remaining allows, up to `want`, all committed at once.
--
-- The burst sent is the limit's burst less the units of one reservation's life (script.rs
-- reserve_call): every decision on a reserving limit is made against it, so a unit spent up to
-- `reserve_ahead` after it was taken never lets the key exceed its own bound.
--
-- KEYS:  [1] the TAT (as decide.lua's gcra key)
-- ARGV:  [1] now override in µs, or -1 for TIME
--        [2] minimum TTL in ms, as for decide.lua
--        [3] count, [4] period (µs), [5] burst (reduced), [6] cost, [7] want
-- Returns {granted (0: rejected), remaining, reset_after, retry_after (rejected), now}.

local now = clock(ARGV[1])
local floor_ms = tonumber(ARGV[2]) or 1
local count, period, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cost, want = tonumber(ARGV[6]), tonumber(ARGV[7])
local t, tau = gcra_consts(count, period, burst)
local tat = num(redis.call('GET', KEYS[1]))
local admitted, remaining, reset_after, wait, new_tat = gcra_check(tat, now, t, tau, cost, burst, 0)
if admitted == 0 then
  return { 0, remaining, reset_after, wait, now }
end
local granted = cost + math.min(math.max(want - cost, 0), remaining)
new_tat = math.max(tat, now) + t * granted
gcra_store(KEYS[1], new_tat, now, floor_ms)
local ahead = new_tat - now
return { granted, gcra_takeable(t, tau, ahead), ahead, 0, now }
