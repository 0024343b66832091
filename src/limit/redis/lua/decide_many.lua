-- decide_many.lua: several requests' decisions in one call, in request order, each exactly as
-- decide.lua would decide it had it been sent alone at that point (its own all-or-nothing
-- across its limits, its own shadow flags, its own reply). Sent as
-- `gcra.lua .. lib.lua .. decide_many.lua`; the batcher (src/limit/redis/batch.rs) sends it
-- for the requests that queued behind a call in flight.
--
-- The requests of a batch mostly repeat the same limits, so each distinct limit is sent once:
-- ARGV:  [1] m, the number of requests
--        [2] s, the number of limit specs; then s specs, each one limit's values as decide.lua
--            takes them (algo, count, period, burst, cost, max_delay, for algo 5 the four
--            window bounds, shadow)
--        then h, the number of shapes; then h shapes, each: now override (-1: the server
--            clock), TTL floor (ms), n, and n spec numbers (1-based): a request's decide.lua
--            header with its limits by number (no spec twice in one shape)
--        then m shape numbers (1-based), one per request, in order
-- KEYS:  per request, in order, its limits' keys as decide.lua takes them (1 per limit,
--        2 for sliding_log); on a cluster all in one slot
-- Returns the server clock's reading (µs; -1 when no request used it), then per request, in
-- order, its decide.lua reply without its first two values (4 per limit): all_admitted follows
-- from the limits' verdicts and shadow flags, and now is the request's override or that
-- reading (batch.rs puts them back).
--
-- Cheaper than m calls: one call's floor instead of m; a limit's arguments sent and parsed
-- once per call; the server clock (TIME) read once, so the batch is decided at one instant,
-- as requests arriving together; the gcra keys read in one MGET, and each written at most
-- once (lib.lua's gcra cache), however many of the requests charge it: m requests on one hot
-- key cost one MGET and one SET.

local m = tonumber(ARGV[1]) or 0
local specs, at = read_limits(tonumber(ARGV[2]) or 0, 2, true, true)
for _, l in ipairs(specs) do
  if l.algo == 1 then
    l.t, l.tau = gcra_consts(l.count, l.period, l.burst)
  end
end

local shapes = {}
local server_now
local nshapes = tonumber(ARGV[at + 1]) or 0
at = at + 1
for i = 1, nshapes do
  local now
  if ARGV[at + 1] == '-1' then
    if server_now == nil then
      server_now = clock('-1')
    end
    now = server_now
  else
    now = clock(ARGV[at + 1])
  end
  local n = tonumber(ARGV[at + 3]) or 0
  local limits, nkeys = {}, 0
  for j = 1, n do
    local l = specs[tonumber(ARGV[at + 3 + j])]
    if l == nil then
      error('tollgate: unknown limit spec in shape ' .. i)
    end
    limits[j] = l
    nkeys = nkeys + ((l.algo == 4) and 2 or 1)
  end
  shapes[i] = { now = now, floor = tonumber(ARGV[at + 2]) or 1, limits = limits, nkeys = nkeys }
  at = at + 3 + n
end

-- Each request's shape, and the gcra keys of the whole batch (each once), read in one MGET.
local of = {}
local cache = gcra_cache()
do
  local gcra, seen, k = {}, {}, 1
  local last_arg, last_shape
  for r = 1, m do
    -- Most requests of a batch have the shape of the one before: no number to parse then.
    local arg = ARGV[at + r]
    local shape = last_shape
    if arg ~= last_arg then
      shape = shapes[tonumber(arg)]
      if shape == nil then
        error('tollgate: unknown shape for request ' .. r)
      end
      last_arg, last_shape = arg, shape
    end
    of[r] = shape
    local limits = shape.limits
    for j = 1, #limits do
      local l = limits[j]
      if l.algo == 1 then
        local key = KEYS[k]
        if not seen[key] then
          seen[key] = true
          gcra[#gcra + 1] = key
        end
        k = k + 1
      elseif l.algo == 4 then
        k = k + 2
      else
        k = k + 1
      end
    end
  end
  if k - 1 ~= #KEYS then
    error('tollgate: ' .. #KEYS .. ' keys for ' .. (k - 1) .. ' expected')
  end
  gcra_prefetch(cache, gcra)
end

local out = { server_now or -1 }
local k = 1
for r = 1, m do
  local shape = of[r]
  local limits = shape.limits
  -- The specs are this request's limits once their keys are its own.
  for j = 1, #limits do
    local l = limits[j]
    l.keys[1] = KEYS[k]
    if l.algo == 4 then
      l.keys[2] = KEYS[k + 1]
      k = k + 2
    else
      k = k + 1
    end
  end
  decide_limits(limits, shape.now, shape.floor, out, #out, cache)
end
gcra_flush(cache)
return out
