-- refund.lua: gives back one limit's units taken by an earlier decide.lua call. Sent as
-- `gcra.lua .. lib.lua .. refund.lua`. Used on a Redis Cluster, where a request's limits on
-- different slots are decided by separate calls: when one rejects, the others' commits are
-- undone.
--
-- KEYS:  the limit's keys, as for decide.lua
-- ARGV:  [1] now override in µs, or -1 for TIME
--        [2] minimum TTL in ms, as for decide.lua
--        [3] the `now` the decide call returned (the instant the units were taken at)
--        then 6: algo, count, period, burst, cost, max_delay (as for decide.lua)
--        (and for algo 5 the four calendar window bounds, see lib.lua)
-- Returns 1 if units were given back, 0 if there was nothing left to give back (the
-- window already passed, or the key expired).

local now = clock(ARGV[1])
local floor_ms = tonumber(ARGV[2]) or 1
local at = tonumber(ARGV[3])
local l = read_limits(1, 3)[1]
return ALG[l.algo].refund(l, at, now, floor_ms)
