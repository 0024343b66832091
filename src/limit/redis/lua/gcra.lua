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
    redis.call('SET', key, fmt(tat), 'PX', fmt(ms))
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

-- One request whose n limits are all gcra (all_gcra), decided as decide.lua decides (which
-- documents the rule): every limit checked, the ones that admitted charged only if every
-- enforced one admitted; decide_gcra.lua's path, which builds no table per limit. The limits'
-- ARGV values follow index `at`, their keys are KEYS[1] on. The reply's 2 + 4n values go into
-- `out`.
local function gcra_decide(at, n, now, floor_ms, out)
  out[1] = 1
  out[2] = now
  local tats = { 0 }
  for i = 1, n do
    local b = at + (i - 1) * 7
    local count, period, burst = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
    local cost, max_delay = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
    if not (count and period and burst and cost and max_delay) then
      error('tollgate: malformed arguments for limit ' .. i)
    end
    local t, tau = gcra_consts(count, period, burst)
    local admitted, remaining, reset_after, wait, new_tat =
      gcra_check(num(redis.call('GET', KEYS[i])), now, t, tau, cost, burst, max_delay)
    tats[i] = new_tat
    local r = 2 + (i - 1) * 4
    out[r + 1] = admitted
    out[r + 2] = remaining
    out[r + 3] = reset_after
    out[r + 4] = wait
    if admitted == 0 and ARGV[b + 7] ~= '1' then
      out[1] = 0
    end
  end
  if out[1] == 1 then
    for i = 1, n do
      if out[3 + (i - 1) * 4] == 1 then
        gcra_store(KEYS[i], tats[i], now, floor_ms)
      end
    end
  end
end
