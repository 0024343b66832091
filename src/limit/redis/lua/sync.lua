-- Eventual-consistency sync of one key: pushes this instance's counts, pulls the totals.
--
-- KEYS[1]: the counter of window W (the key's current window on the caller's side),
-- KEYS[2]: the counter of window W - period. Both share the limit's hash tag.
-- ARGV[1]: units admitted locally in W since the last push; ARGV[2]: the same for W - period;
-- ARGV[3]: TTL in ms for a counter written (two periods: after that no decision reads it).
-- Returns {total of W, total of W - period, server time in µs}.
local function push(key, delta, ttl)
  if delta > 0 then
    local total = redis.call('INCRBY', key, delta)
    redis.call('PEXPIRE', key, ttl)
    return total
  end
  return tonumber(redis.call('GET', key) or '0')
end
local ttl = tonumber(ARGV[3])
local curr = push(KEYS[1], tonumber(ARGV[1]), ttl)
local prev = push(KEYS[2], tonumber(ARGV[2]), ttl)
local t = redis.call('TIME')
return {curr, prev, tonumber(t[1]) * 1000000 + tonumber(t[2])}
