-- settle.lua: after a response, charges or gives back the difference between a request's
-- true cost and the estimate its decision charged, on the same key (the rate algorithms, 1 to
-- 5; see lib.lua's settle functions and src/limit/algorithm/settle.rs, which they mirror).
-- Sent as `gcra.lua .. lib.lua .. settle.lua`.
--
-- KEYS:  the limit's keys, as for decide.lua
-- ARGV:  [1] now override in µs, or -1 for the server clock (TIME)
--        [2] minimum TTL in ms, as for decide.lua
--        [3] the `now` the decide call returned (the instant the estimate was charged at)
--        [4] delta: true cost minus the estimate (> 0 charges more, < 0 gives back)
--        [5] full_at: when the admission left the key full again, [3] plus its reply's
--            reset_after (gcra: the TAT it stored, which a charge starts from; the other
--            algorithms do not read it)
--        then 6: algo, count, period, burst, cost (the estimate), max_delay
--        (and for algo 5 the four calendar window bounds around the instance's clock now, as
--        for decide.lua: the window a settlement writes is the one holding Redis's `now`)
-- Returns 1 if the key's state changed, 0 if there was nothing to settle.

local now = clock(ARGV[1])
local floor_ms = tonumber(ARGV[2]) or 1
local at = tonumber(ARGV[3])
local delta = tonumber(ARGV[4])
local full_at = tonumber(ARGV[5])
local l = read_limits(1, 5)[1]
local settle = ALG[l.algo].settle
if not (settle and at and delta and full_at) then
  error('tollgate: cannot settle algorithm ' .. tostring(l.algo))
end
return settle(l, at, delta, now, floor_ms, full_at)
