-- release.lua: gives back the leases of concurrency slots whose requests ended (see lib.lua's
-- concurrency section). Sent as `gcra.lua .. release.lua`: it needs the helpers only.
--
-- KEYS:  one lease set per lease (on a cluster, all in one hash slot)
-- ARGV:  [1] now override in µs, or -1 for the server clock (TIME)
--        then one lease id per key
-- Returns per lease 1 if it was still held, 0 if it had run out (its instance failed to renew
-- it in time) or the key had been reset: either way the slot was already free.

local now = clock(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local score = redis.call('ZSCORE', key, ARGV[i + 1])
  local held = 0
  if score and tonumber(score) > now then
    held = 1
  end
  if score then
    redis.call('ZREM', key, ARGV[i + 1])
  end
  -- Leases of instances gone: trimmed while here. Redis deletes a set left empty.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
  out[i] = held
end
return out
