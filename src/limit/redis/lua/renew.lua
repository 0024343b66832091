-- renew.lua: moves on the expiry of leases whose requests still run (see lib.lua's concurrency
-- section), so that only a dead instance's slots wait out their lease. Sent as
-- `gcra.lua .. renew.lua`: it needs the helpers only.
--
-- KEYS:  one lease set per lease (on a cluster, all in one hash slot)
-- ARGV:  [1] now override in µs, or -1 for the server clock (TIME)
--        [2] minimum TTL in ms for the keys (as for decide.lua)
--        then per key: the lease id, the lease's length in µs
-- Returns per lease 1 if renewed (it now runs out a whole lease from now), 0 if it had already
-- run out or the key had been reset: the slot is no longer counted, and is not taken again.

local now = clock(ARGV[1])
local floor_ms = tonumber(ARGV[2]) or 1
local out = {}
for i, key in ipairs(KEYS) do
  local id = ARGV[1 + 2 * i]
  local lease = tonumber(ARGV[2 + 2 * i])
  local score = redis.call('ZSCORE', key, id)
  if score and tonumber(score) > now and lease then
    redis.call('ZADD', key, 'XX', fmt(now + lease), id)
    local ms = math.max(1, fdiv(lease + 999, 1000), floor_ms)
    if redis.call('PTTL', key) < ms then
      redis.call('PEXPIRE', key, ms)
    end
    out[i] = 1
  else
    if score then
      redis.call('ZREM', key, id)
    end
    out[i] = 0
  end
end
return out
