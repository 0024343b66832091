-- gcra.lua: the helpers every script needs and the gcra arithmetic, first in every script
-- (script.rs sends `gcra.lua .. lib.lua .. <entry point>`, and decide.lua's gcra-only path
-- before lib.lua). Kept apart from lib.lua because a script's whole body runs on every call:
-- a decision whose limits are all gcra (the common case) returns before lib.lua has defined
-- anything, and every closure or table a call creates costs Redis CPU (see script.rs).
--
-- The arithmetic mirrors src/limit/algorithm/gcra.rs step for step; see lib.lua for the
-- numeric range (doubles, exact below 2^53).

-- floor(a / b) for integers, corrected for the rounding of the double quotient.
local function fdiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- Integers as Redis arguments: tostring(1.7e15) would print "1.7e+15". '%d' formats through
-- a C long (64 bits here), exact for every value these scripts write (< 2^53), and costs
-- Redis less than half what '%.0f' does.
local function fmt(x)
  return string.format('%d', x)
end

local function num(v)
  return tonumber(v) or 0
end

-- The clock: Redis's own (so instances with skewed clocks agree), unless a test overrides it.
local function clock(override)
  -- '-1' (the server's clock, every production call) is told without parsing a number.
  if override ~= '-1' then
    local now = tonumber(override)
    if now and now >= 0 then
      return now
    end
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The emission interval t of a quota and its tolerance tau (= t × burst).
local function gcra_consts(count, period, burst)
  local t = math.max(1, fdiv(period + math.max(1, count) - 1, math.max(1, count)))
  return t, t * burst
end

-- Units a full bucket could take with the TAT `ahead` of now.
local function gcra_takeable(t, tau, ahead)
  return fdiv(tau - math.min(ahead, tau), t)
end

-- One check against the stored TAT (0: none). Returns admitted (1|0), remaining,
-- reset_after, retry_after (rejected) or delay (admitted), and the TAT to store on commit.
local function gcra_check(tat, now, t, tau, cost, burst, max_delay)
  local base = math.max(tat, now)
  local new_tat = base + t * cost
  local allow_at = math.max(0, new_tat - tau)
  if allow_at > now then
    local wait = allow_at - now
    if wait <= max_delay and cost <= burst then
      return 1, 0, new_tat - now, wait, new_tat
    end
    -- With waits of up to max_delay allowed, the same request is admitted that much sooner.
    if max_delay > 0 and cost <= burst then
      wait = wait - max_delay
    end
    return 0, gcra_takeable(t, tau, base - now), base - now, wait, new_tat
  end
  return 1, gcra_takeable(t, tau, new_tat - now), new_tat - now, 0, new_tat
end

-- Stores a TAT until it has passed (a TAT already past is a full bucket: the key goes).
local function gcra_store(key, tat, now, floor_ms)
  if tat <= now then
    redis.call('DEL', key)
  else
    local ms = math.max(1, fdiv(tat - now + 999, 1000), floor_ms)
    redis.call('SET', key, fmt(tat), 'PX', ms)
  end
end

-- Whether the n limits whose ARGV values follow index `at` are all gcra: each is then 7 values
-- (code, count, period, burst, cost, max_delay, shadow) and one key. Strides of 7 hold up to
-- the first limit that is not gcra, whose code is read where it is: a calendar limit's longer
-- arguments (lib.lua) come after its code.
local function all_gcra(at, n)
  if n <= 0 then
    return false
  end
  for i = 0, n - 1 do
    if ARGV[at + 1 + i * 7] ~= '1' then
      return false
    end
  end
  return true
end

-- decide_many.lua's cache of gcra keys: the TAT each key has as the batch has left it so far
-- (0: none, as GET of a missing or deleted key reads), and for a key the batch charged, the
-- `now` and TTL floor of its last commit, written once at the end (gcra_flush) in the order
-- first charged.
local function gcra_cache()
  return { tat = {}, now = {}, floor = {}, order = {} }
end

-- A key's TAT: from the cache, or read once and remembered.
local function gcra_cached(cache, key)
  local tat = cache.tat[key]
  if tat == nil then
    tat = num(redis.call('GET', key))
    cache.tat[key] = tat
  end
  return tat
end

-- gcra_store into the cache: what a later decision of the batch reads is what it would have
-- read after gcra_store (a TAT already past deletes the key: 0).
local function gcra_defer(cache, key, tat, now, floor_ms)
  if cache.now[key] == nil then
    cache.order[#cache.order + 1] = key
  end
  if tat <= now then
    tat = 0
  end
  cache.tat[key], cache.now[key], cache.floor[key] = tat, now, floor_ms
end

-- Each key the batch charged, written once, as its last commit would have written it.
local function gcra_flush(cache)
  for _, key in ipairs(cache.order) do
    gcra_store(key, cache.tat[key], cache.now[key], cache.floor[key])
  end
end

-- One request whose n limits are all gcra (all_gcra), decided as decide.lua decides (which
-- documents the rule): every limit checked, the ones that admitted charged only if every
-- enforced one admitted. The limits' ARGV values follow index `at`, their keys are KEYS[k] on.
-- The reply's 2 + 4n values go into `out` after index `o`. Without `cache` each key is read
-- with GET and written at once (decide_gcra.lua); with one, through it (decide_many.lua).
local function gcra_decide(at, k, n, now, floor_ms, out, o, cache)
  out[o + 1] = 1
  out[o + 2] = now
  local tats = { 0 }
  for i = 1, n do
    local b = at + (i - 1) * 7
    local count, period, burst = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
    local cost, max_delay = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
    if not (count and period and burst and cost and max_delay) then
      error('tollgate: malformed arguments for limit ' .. i)
    end
    local t, tau = gcra_consts(count, period, burst)
    local key = KEYS[k + i - 1]
    local tat
    if cache then
      tat = gcra_cached(cache, key)
    else
      tat = num(redis.call('GET', key))
    end
    local admitted, remaining, reset_after, wait, new_tat =
      gcra_check(tat, now, t, tau, cost, burst, max_delay)
    tats[i] = new_tat
    local r = o + 2 + (i - 1) * 4
    out[r + 1] = admitted
    out[r + 2] = remaining
    out[r + 3] = reset_after
    out[r + 4] = wait
    if admitted == 0 and ARGV[b + 7] ~= '1' then
      out[o + 1] = 0
    end
  end
  if out[o + 1] == 1 then
    for i = 1, n do
      if out[o + 3 + (i - 1) * 4] == 1 then
        if cache then
          gcra_defer(cache, KEYS[k + i - 1], tats[i], now, floor_ms)
        else
          gcra_store(KEYS[k + i - 1], tats[i], now, floor_ms)
        end
      end
    end
  end
end
