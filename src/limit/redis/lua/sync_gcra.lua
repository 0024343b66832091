-- Eventual-consistency sync of one gcra key: adds this instance's units to the shared TAT,
-- returns the TAT. The key is the one decide.lua uses for the same limit and client, so a
-- limit switched between strict and eventual keeps its state.
--
-- KEYS[1]: the TAT (µs of Redis time, a string; absent = full bucket)
-- ARGV[1]: units admitted here since the last push; ARGV[2]: T, µs per unit;
-- ARGV[3]: tau (T × burst), how far past now a TAT can be
-- The units are charged as if they all came now: the TAT moves on from max(TAT, now). For a
-- key this instance holds alone that is exactly its own TAT while the bucket is busy (the
-- only time a TAT decides anything), and never less otherwise, so a sync cannot give back
-- budget. The TAT is capped at now + tau, where no admission can leave it: units held back
-- through a long Redis outage must not lock the client out for longer than an empty bucket
-- would. The key expires when its TAT is reached: the bucket is full again.
-- Returns {TAT, server time in µs}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local units = tonumber(ARGV[1]) or 0
local interval = tonumber(ARGV[2]) or 1
local tau = tonumber(ARGV[3]) or 0
if units > 0 then
  tat = math.min(math.max(tat, now) + units * interval, now + tau)
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.max(1, math.ceil((tat - now) / 1000)))
end
return { tat, now }
