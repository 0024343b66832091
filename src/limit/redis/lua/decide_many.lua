-- decide_many.lua: several requests' decisions in one call, in ARGV order, each exactly as
-- decide.lua would decide it had it been sent alone at that point (its own all-or-nothing
-- across its limits, its own shadow flags, its own reply). Sent as
-- `gcra.lua .. lib.lua .. decide_many.lua`; the batcher (src/limit/redis/batch.rs) sends it
-- for the requests that queued behind a call in flight.
--
-- KEYS:  per request, in order, that request's decide.lua KEYS (on a cluster all in one slot)
-- ARGV:  [1] m, the number of requests; then per request its decide.lua ARGV: now override
--        (-1: the server clock), TTL floor (ms), n, and its n limits
-- Returns per request, in order, its decide.lua reply (2 + 4n values), concatenated.
--
-- Cheaper than m calls: one call's floor instead of m; the server clock (TIME) read once,
-- so the batch is decided at one instant, as requests arriving together; and each gcra key
-- read at most once and written at most once (gcra.lua's cache), however many of the
-- requests charge it: n requests on one hot key cost one GET and one SET. A request whose
-- limits are all gcra takes gcra_decide, as decide_gcra.lua does; the others decide_limits
-- (lib.lua), which reads and writes the other algorithms' keys as decide.lua does.

local m = tonumber(ARGV[1]) or 0
local out = {}
local cache = gcra_cache()
local server_now
local at, k = 1, 1
for _ = 1, m do
  local now
  if ARGV[at + 1] == '-1' then
    if server_now == nil then
      server_now = clock('-1')
    end
    now = server_now
  else
    now = clock(ARGV[at + 1])
  end
  local floor_ms = tonumber(ARGV[at + 2]) or 1
  local n = tonumber(ARGV[at + 3]) or 0
  if all_gcra(at + 3, n) then
    gcra_decide(at + 3, k, n, now, floor_ms, out, #out, cache)
    at, k = at + 3 + n * 7, k + n
  else
    local limits
    limits, at, k = read_limits(n, at + 3, true, k)
    decide_limits(limits, now, floor_ms, out, #out, cache)
  end
end
gcra_flush(cache)
return out
