-- peek.lua: the current state of one limit's key, read-only, for the admin API. Sent as
-- `gcra.lua .. lib.lua .. peek.lua`.
--
-- KEYS:  the limit's keys, as for decide.lua
-- ARGV:  [1] now override in µs, or -1 for TIME
--        then 6: algo, count, period, burst, cost, max_delay (cost and max_delay unused)
--        (and for algo 5 the four calendar window bounds, see lib.lua)
-- Returns {remaining, reset_after (µs), now (µs)}.

local now = clock(ARGV[1])
local l = read_limits(1, 1)[1]
local alg = ALG[l.algo]
local remaining, reset_after = alg.peek(l, alg.load(l), now)
return { remaining, reset_after, now }
