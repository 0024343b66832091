-- Eventual-consistency sync of one key: pushes this instance's counts, pulls the totals.
--
-- KEYS[1]: the counter of window W (the key's current window on the caller's side),
-- KEYS[2]: the counter of window W - period. Both share the limit's hash tag.
-- ARGV[1]: units admitted locally in W since the last push; ARGV[2]: the same for W - period;
-- ARGV[3]: W, the window's start in µs of Redis time; ARGV[4]: how long after its start a
-- window's counter is still read, in µs (fixed_window: one period; sliding_window: two, as the
-- previous window of the next one); ARGV[5]: the period in µs.
-- A counter written expires when no decision reads it any more: when its state is full again.
-- Returns {total of W, total of W - period, server time in µs}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ws = tonumber(ARGV[3])
local life = tonumber(ARGV[4])
local period = tonumber(ARGV[5])
local function ttl(start)
  local ms = math.ceil((start + life - now) / 1000)
  if ms < 1 then
    ms = 1
  end
  return ms
end
local function push(key, delta, start)
  if delta > 0 then
    local total = redis.call('INCRBY', key, delta)
    redis.call('PEXPIRE', key, ttl(start))
    return total
  end
  return tonumber(redis.call('GET', key) or '0')
end
local curr = push(KEYS[1], tonumber(ARGV[1]), ws)
local prev = push(KEYS[2], tonumber(ARGV[2]), ws - period)
return {curr, prev, now}
