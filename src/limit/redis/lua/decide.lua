-- decide.lua: one decision for all of a request's global limits, atomically. Sent as
-- `gcra.lua .. decide_gcra.lua .. lib.lua .. decide.lua` (see lib.lua for the per-limit
-- parameters and keys); decide_gcra.lua answers first when every limit is gcra.
--
-- The rule (lib.lua's decide_limits, which decide_many.lua shares): every limit is checked first; only if every enforced limit admits is anything committed
-- (each limit that admitted, shadow ones included), so a rejected request writes nothing and
-- a shadow limit is charged exactly when the request goes through, as in process. Written keys
-- expire once their state is back to full.
--
-- KEYS:  per limit, in ARGV order: 1 key (gcra, fixed_window, sliding_window) or
--        2 keys (sliding_log: entries zset, meta hash); all in one hash slot on a cluster.
-- ARGV:  [1] now override in µs, or -1 for the server clock (TIME)
--        [2] minimum TTL in ms for written keys (1 in production; tests with an overridden
--            clock raise it, since their timeline does not follow the TTL's real clock)
--        [3] n, the number of limits
--        then per limit: algo, count, period, burst, cost, max_delay, for algo 5 the four
--        calendar window bounds (see lib.lua), and shadow (1: a shadow limit, whose rejection
--        does not stop the others; 0 otherwise)
-- Returns a flat integer array of 2 + 4n values:
--        all_admitted (1|0: every enforced limit admitted), now (µs, the instant the decision was taken at),
--        then per limit: admitted (1|0), remaining, reset_after (µs),
--        retry_after (µs, if rejected) or delay (µs, if admitted; > 0 only for a reservation)
-- For a rejected request the limits that would have admitted report their check, though
-- nothing was committed.

local now = clock(ARGV[1])
local out = { 1, now }
out[1] = decide_limits(read_limits(tonumber(ARGV[3]) or 0, 3, true), now, tonumber(ARGV[2]) or 1, out, 2)
return out
