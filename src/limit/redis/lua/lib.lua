-- lib.lua: the algorithms on Redis keys. Not a script by itself: script.rs sends
-- `gcra.lua .. lib.lua .. decide.lua` (or refund.lua, peek.lua) as one script, so the three
-- entry points share one copy of the arithmetic. gcra.lua holds the helpers (fdiv, fmt, num,
-- clock) and the gcra arithmetic, which decide.lua's gcra-only path uses without this file.
--
-- Every function mirrors src/limit/algorithm/*.rs step for step: same integer formulas, same
-- order, same rounding. Lua 5.1 numbers are doubles, exact up to 2^53; script.rs refuses
-- parameters that could leave that range (µs since 1970 are ~1.7e15), and the one product
-- that can exceed it (sliding_window's count × period) goes through muldiv below.
--
-- Per-limit parameters (6 ARGV values, in this order):
--   algo       1 gcra | 2 fixed_window | 3 sliding_window | 4 sliding_log
--              | 5 fixed_window on calendar windows (align: calendar) | 6 concurrency
--   count      units per period (> 0); concurrency: max_in_flight
--   period     µs (> 0); for 5 the windows' nominal length, which nothing here uses;
--              concurrency: the lease's length
--   burst      gcra: units takeable at once from a full bucket; concurrency: this request's
--              lease id (< 2^50, chosen by the instance); ignored by the others
--   cost       units this request takes
--   max_delay  gcra: admit with a delay up to this many µs (0 = never); ignored by the others
-- and for algo 5 four more: b1 <= b2 <= b3 <= b4, the starts of the windows before, holding
-- and after the instance's own clock, and the end of the one after. Redis's clock decides:
-- the window of [b1, b2), [b2, b3), [b3, b4) that holds its TIME is the one counted in, and
-- none holding it (the clocks differ by more than a window) is an error, not a guess.
-- Keys per limit: sliding_log 2 (zset of entries, hash {sum, seq}); the others 1
-- (gcra: string = tat; fixed_window (2 and 5): hash {s, c}; sliding_window: hash {s, c, p};
-- concurrency: zset of lease ids scored by their expiry).

-- Keys live until their state is back to full, so idle keys cost no memory. A key already
-- full is deleted rather than kept for a millisecond.
local function expire(keys, full_at, now, floor_ms)
  if full_at <= now then
    for _, k in ipairs(keys) do
      redis.call('DEL', k)
    end
    return
  end
  local ms = math.max(1, fdiv(full_at - now + 999, 1000), floor_ms)
  for _, k in ipairs(keys) do
    redis.call('PEXPIRE', k, ms)
  end
end

-- Reads `n` limits from ARGV starting after index `at`, taking their keys from KEYS in order.
-- With `shadow` (decide.lua), each limit ends with one more value: 1 for a shadow limit, else
-- 0. With `no_keys` (decide_many.lua's limit specs) the keys are left empty, for the caller to
-- fill in per request. Also returns the ARGV index of the last value read.
local function read_limits(n, at, shadow, no_keys)
  local limits, k, b = {}, 1, at
  for i = 1, n do
    local l = {
      algo = tonumber(ARGV[b + 1]),
      count = tonumber(ARGV[b + 2]),
      period = tonumber(ARGV[b + 3]),
      burst = tonumber(ARGV[b + 4]),
      cost = tonumber(ARGV[b + 5]),
      max_delay = tonumber(ARGV[b + 6]),
      keys = { KEYS[k] },
    }
    if no_keys then
      l.keys[1] = nil
    end
    b = b + 6
    if l.algo == 5 then
      l.bounds = { tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
        tonumber(ARGV[b + 4]) }
      b = b + 4
      if not (l.bounds[1] and l.bounds[2] and l.bounds[3] and l.bounds[4]) then
        error('tollgate: malformed calendar windows for limit ' .. i)
      end
    end
    if shadow then
      l.shadow = ARGV[b + 1] == '1'
      b = b + 1
    end
    if no_keys then
      -- keys filled in per request
    elseif l.algo == 4 then
      l.keys[2] = KEYS[k + 1]
      k = k + 2
    else
      k = k + 1
    end
    if not (l.algo and l.count and l.period and l.burst and l.cost and l.max_delay) then
      error('tollgate: malformed arguments for limit ' .. i)
    end
    if l.algo < 1 or l.algo > 6 then
      error('tollgate: unknown algorithm ' .. tostring(l.algo))
    end
    if not no_keys and l.keys[#l.keys] == nil then
      error('tollgate: missing key for limit ' .. i)
    end
    limits[i] = l
  end
  return limits, b
end

-- The start of the fixed window holding `now`, and the time left until it ends.
local function window(period, now)
  local into = now - fdiv(now, period) * period
  return now - into, period - into
end

-- A settled count: `c` moved by delta, a charge adding, a refund taking away no more than
-- there is; nil when nothing changes (no delta, or a refund with nothing to give back).
-- Mirrors settle.rs's `moved`.
local function moved(c, delta)
  if delta > 0 then
    return c + delta
  elseif delta < 0 and c > 0 then
    return math.max(0, c + delta)
  end
  return nil
end

-- Each algorithm: load(l) -> state; check(l, s, now) -> admitted, remaining, reset_after,
-- retry_after_or_delay; commit(l, s, now, floor_ms) writes what check decided;
-- peek(l, s, now) -> remaining, reset_after; refund(l, at, now, floor_ms) undoes one commit
-- made at `at`; the rate algorithms (1 to 5) also settle(l, at, delta, now, floor_ms, full_at)
-- -> 1|0: the request charged `l.cost` at `at` (which left the key full again at `full_at`, read
-- by gcra only) really cost `l.cost + delta` (src/limit/algorithm/settle.rs, which it mirrors).
local ALG = {}

-- A script's body runs on every call, so the algorithms are built on first use: defining
-- all the algorithms' closures on every decision cost Redis more CPU than the decision
-- itself (see script.rs). BUILD[code](code) defines ALG[code].
local BUILD = {}
setmetatable(ALG, {
  __index = function(t, code)
    local build = BUILD[code]
    if build then
      build(code)
    end
    return rawget(t, code)
  end,
})

-- gcra -------------------------------------------------------------------------------------

BUILD[1] = function()
  ALG[1] = {
    load = function(l)
      local t, tau = gcra_consts(l.count, l.period, l.burst)
      return { tat = num(redis.call('GET', l.keys[1])), t = t, tau = tau }
    end,
    check = function(l, s, now)
      local admitted, remaining, reset_after, wait, new_tat =
        gcra_check(s.tat, now, s.t, s.tau, l.cost, l.burst, l.max_delay)
      s.new_tat = new_tat
      return admitted, remaining, reset_after, wait
    end,
    commit = function(l, s, now, floor_ms)
      gcra_store(l.keys[1], s.new_tat, now, floor_ms)
    end,
    peek = function(l, s, now)
      local ahead = math.max(s.tat, now) - now
      return gcra_takeable(s.t, s.tau, ahead), ahead
    end,
    -- Without this request, a commit made between `at` and now would have started from its own
    -- instant rather than from this request's TAT: up to `now - at` of the emission is
    -- therefore not given back, so a refund never leaves the bucket laxer than if the request
    -- had not come (exact when refunded at `at`; nothing once the request has drained).
    refund = function(l, at, now, floor_ms)
      local s = ALG[1].load(l)
      local back = s.t * l.cost - math.max(0, now - at)
      if s.tat == 0 or back <= 0 then
        return 0
      end
      gcra_store(l.keys[1], s.tat - back, now, floor_ms)
      return 1
    end,
    -- The TAT moves by delta × t: a charge from no earlier than the TAT the admission left
    -- (`full_at`: a key refilled or expired meanwhile is charged as the request would have
    -- been), a refund from the TAT as it is, of no more than `full_at - now`. The key may go
    -- into debt (a TAT past now + tau).
    settle = function(l, at, delta, now, floor_ms, full_at)
      local s = ALG[1].load(l)
      if delta > 0 then
        -- A TAT already past is a full bucket, whether or not its key has expired yet (its TTL
        -- is rounded up to whole ms, and never below floor_ms): read as none, as the local
        -- store forgets it. The anchor keeps the charge strict.
        local live = s.tat
        if live <= now then
          live = 0
        end
        local tat = math.max(live, full_at) + s.t * delta
        gcra_store(l.keys[1], tat, now, floor_ms)
        return 1
      end
      if delta == 0 or s.tat == 0 then
        return 0
      end
      -- Only the part of the charge still ahead of now: what has drained may have been taken
      -- again by a request admitted meanwhile.
      local back = math.min(-delta * s.t, math.max(0, full_at - now))
      if back <= 0 then
        return 0
      end
      gcra_store(l.keys[1], math.max(0, s.tat - back), now, floor_ms)
      return 1
    end,
  }
end

-- fixed_window -----------------------------------------------------------------------------
-- One body for 2 (epoch windows) and 5 (calendar windows): BUILD[5] is BUILD[2], which
-- builds ALG[code] around that code's window function `win(l, s, now)`: the start of the
-- window holding `now` and the time left in it (for calendar windows, nil when none of the
-- three the instance sent holds `now`). Defined inside the builder, so a call that uses
-- neither creates none of their closures, and algorithm 2's arithmetic is the call it was.

BUILD[2] = function(code)
  code = code or 2
  local win, window_of
  if code == 5 then
    win = function(l, _, now)
      local b = l.bounds
      for j = 1, 3 do
        if b[j] <= now and now < b[j + 1] then
          return b[j], b[j + 1] - now
        end
      end
      return nil
    end
    -- The window of `now`, or an error naming both clocks: counting in a window Redis's
    -- clock is not in would give a client a budget of the wrong day.
    window_of = function(l, s, now)
      local ws, to_end = win(l, s, now)
      if ws == nil then
        error('tollgate: redis time ' .. fmt(now) .. ' is outside the calendar windows sent ('
          .. fmt(l.bounds[1]) .. ' to ' .. fmt(l.bounds[4])
          .. '): the instance clock and redis clock differ by more than a window')
      end
      return ws, to_end
    end
  else
    -- `window` itself, inline: a call level less for every fixed_window decision.
    win = function(_, s, now)
      local into = now - fdiv(now, s.period) * s.period
      return now - into, s.period - into
    end
    window_of = win
  end
  local alg
  alg = {
    load = function(l)
      local v = redis.call('HMGET', l.keys[1], 's', 'c')
      return { start = num(v[1]), count = num(v[2]), period = math.max(1, l.period) }
    end,
    check = function(l, s, now)
      local ws, to_end = window_of(l, s, now)
      local c = (s.start == ws) and s.count or 0
      if c + l.cost > l.count then
        return 0, math.max(0, l.count - c), to_end, to_end
      end
      local reset = 0
      if c + l.cost > 0 then
        reset = to_end
      end
      return 1, l.count - c - l.cost, reset, 0
    end,
    commit = function(l, s, now, floor_ms)
      local ws, to_end = window_of(l, s, now)
      if s.start ~= ws then
        s.start, s.count = ws, 0
      end
      s.count = s.count + l.cost
      if s.count == 0 then
        redis.call('DEL', l.keys[1])
        return
      end
      redis.call('HSET', l.keys[1], 's', fmt(s.start), 'c', fmt(s.count))
      -- The window's end: s.start + period for epoch windows.
      expire(l.keys, now + to_end, now, floor_ms)
    end,
    peek = function(l, s, now)
      local ws, to_end = window_of(l, s, now)
      local c = (s.start == ws) and s.count or 0
      if c > 0 then
        return math.max(0, l.count - c), to_end
      end
      return math.max(0, l.count - c), 0
    end,
    -- Only the window the units were taken in holds them; once it has passed (or is not one
    -- the call knows) there is nothing left to give back.
    refund = function(l, at, _, _)
      local s = alg.load(l)
      if s.count == 0 or s.start ~= win(l, s, at) then
        return 0
      end
      local c = math.max(0, s.count - l.cost)
      if c == 0 then
        redis.call('DEL', l.keys[1])
      else
        redis.call('HSET', l.keys[1], 'c', fmt(c))
      end
      return 1
    end,
    -- The count of the window holding `now` moves by delta: a charge whatever window `at` was
    -- in (once the admission's window is over, the consumer pays in the current one), a refund
    -- only while `at`'s window is the current one, never below 0. For 5 the windows are sent
    -- around the instance's clock at the settlement, so `now`'s is among them.
    settle = function(l, at, delta, now, floor_ms)
      local s = alg.load(l)
      local ws, to_end = window_of(l, s, now)
      if delta < 0 and at < ws then
        return 0
      end
      local c = moved((s.start == ws) and s.count or 0, delta)
      if c == nil then
        return 0
      end
      if c == 0 then
        redis.call('DEL', l.keys[1])
        return 1
      end
      redis.call('HSET', l.keys[1], 's', fmt(ws), 'c', fmt(c))
      expire(l.keys, now + to_end, now, floor_ms)
      return 1
    end,
  }
  ALG[code] = alg
end
BUILD[5] = BUILD[2]

-- sliding_window ---------------------------------------------------------------------------

BUILD[3] = function()
  local EXACT = 9007199254740992 -- 2^53
  -- floor(a * b / c) and the remainder, exact whenever the quotient is below 2^53 even if
  -- a * b is not. Beyond 2^53 it splits a and b by c and multiplies the remainders by
  -- doubling, keeping every intermediate value below c.
  local function muldiv(a, b, c)
    local p = a * b
    if p < EXACT then
      local q = fdiv(p, c)
      return q, p - q * c
    end
    local qa = fdiv(a, c)
    local ra = a - qa * c
    local qb = fdiv(b, c)
    local rb = b - qb * c
    local bits = {}
    while rb > 0 do
      local h = fdiv(rb, 2)
      bits[#bits + 1] = rb - 2 * h
      rb = h
    end
    local q, r = 0, 0
    for i = #bits, 1, -1 do
      q = 2 * q
      if r >= c - r then
        r = r - (c - r)
        q = q + 1
      else
        r = r + r
      end
      if bits[i] == 1 then
        if r >= c - ra then
          r = r - (c - ra)
          q = q + 1
        else
          r = r + ra
        end
      end
    end
    return qa * b + ra * qb + q, r
  end


  local function sw_normalise(l, s, now)
    local ws, to_end = window(s.period, now)
    local prev, curr = 0, 0
    if s.start == ws then
      prev, curr = s.prev, s.curr
    elseif s.start + s.period == ws then
      prev, curr = s.curr, 0
    end
    -- weight = ceil(prev * to_end / period): prev's share still inside the sliding period, in
    -- units rounded up. Every comparison with count × period reduces to one with weight, which
    -- keeps the numbers small (the Rust code compares the products in u128).
    local q, r = muldiv(prev, to_end, s.period)
    if r > 0 then
      q = q + 1
    end
    return { ws = ws, to_end = to_end, prev = prev, curr = curr, weight = q }
  end

  -- Whole units takeable with `curr` units in the current window.
  local function sw_remaining(l, n, curr)
    if curr > l.count then
      return 0
    end
    return math.max(0, l.count - curr - n.weight)
  end

  local function sw_reset_after(s, n, prev, curr)
    if curr > 0 then
      return n.to_end + s.period
    elseif prev > 0 then
      return n.to_end
    end
    return 0
  end

  -- Writes the counters of window `ws` (`curr` in it, `prev` in the one before), with the key
  -- expiring once neither counts any more; deletes the key when that is already so.
  local function sw_store(l, period, ws, curr, prev, now, floor_ms)
    local full_at = 0
    if curr > 0 then
      full_at = ws + 2 * period
    elseif prev > 0 then
      full_at = ws + period
    end
    if full_at <= now then
      redis.call('DEL', l.keys[1])
      return
    end
    redis.call('HSET', l.keys[1], 's', fmt(ws), 'c', fmt(curr), 'p', fmt(prev))
    expire(l.keys, full_at, now, floor_ms)
  end

  -- The smallest d >= 1 at which the same request is admitted if nothing else is.
  local function sw_retry_after(l, s, n)
    local a = l.count - n.curr - l.cost
    -- (a) later in this window, while prev's weight falls: x < to_end  <=>  a < weight.
    if a >= 0 and n.prev > 0 and a < n.weight then
      local x = muldiv(a, s.period, n.prev)
      if x >= 1 then
        return n.to_end - x
      end
    end
    -- (b) e µs into the next window, where curr has become prev.
    local e = 0
    local b = math.max(0, l.count - l.cost)
    if n.curr > 0 and b < n.curr then
      e = s.period - muldiv(b, s.period, n.curr)
    end
    return n.to_end + e
  end

  ALG[3] = {
    load = function(l)
      local v = redis.call('HMGET', l.keys[1], 's', 'c', 'p')
      return { start = num(v[1]), curr = num(v[2]), prev = num(v[3]), period = math.max(1, l.period) }
    end,
    check = function(l, s, now)
      local n = sw_normalise(l, s, now)
      s.n = n
      local after = n.curr + l.cost
      if after <= l.count and n.weight <= l.count - after then
        return 1, l.count - after - n.weight, sw_reset_after(s, n, n.prev, after), 0
      end
      return 0, sw_remaining(l, n, n.curr), sw_reset_after(s, n, n.prev, n.curr), sw_retry_after(l, s, n)
    end,
    commit = function(l, s, now, floor_ms)
      local n = s.n or sw_normalise(l, s, now)
      sw_store(l, s.period, n.ws, n.curr + l.cost, n.prev, now, floor_ms)
    end,
    peek = function(l, s, now)
      local n = sw_normalise(l, s, now)
      return sw_remaining(l, n, n.curr), sw_reset_after(s, n, n.prev, n.curr)
    end,
    -- The units sit in `curr` of the window they were taken in, or in `prev` once a later
    -- commit has rolled that window back by one.
    refund = function(l, at, now, floor_ms)
      local s = ALG[3].load(l)
      local ws = window(s.period, at)
      if s.start == ws and s.curr > 0 then
        s.curr = math.max(0, s.curr - l.cost)
      elseif s.start == ws + s.period and s.prev > 0 then
        s.prev = math.max(0, s.prev - l.cost)
      else
        return 0
      end
      sw_store(l, s.period, s.start, s.curr, s.prev, now, floor_ms)
      return 1
    end,
    -- The counters rolled to `now`'s window, then the one holding `at` moves by delta: curr
    -- (admitted in this window) or prev (in the one before, which the estimate still reads),
    -- never below 0. An older admission is no longer counted: nothing changes.
    settle = function(l, at, delta, now, floor_ms)
      if delta == 0 then
        return 0
      end
      local s = ALG[3].load(l)
      local n = sw_normalise(l, s, now)
      local curr, prev = n.curr, n.prev
      local admitted_in = window(s.period, at)
      if admitted_in == n.ws then
        curr = moved(curr, delta)
      elseif admitted_in + s.period == n.ws then
        prev = moved(prev, delta)
      else
        return 0
      end
      if curr == nil or prev == nil then
        return 0
      end
      sw_store(l, s.period, n.ws, curr, prev, now, floor_ms)
      return 1
    end,
  }
end

-- sliding_log ------------------------------------------------------------------------------
-- Entries are zset members "<seq>:<cost>" scored by their timestamp; the hash keeps the
-- running sum (expired entries included until a commit drops them) and the seq counter that
-- keeps members unique. The Rust log merges entries of one instant; separate members with
-- equal scores decide identically.

BUILD[4] = function()
  local function entry_cost(member)
    return tonumber(string.match(member, ':(%d+)$')) or 0
  end

  local function log_last_ts(l)
    local last = redis.call('ZRANGE', l.keys[1], -1, -1, 'WITHSCORES')
    if #last == 0 then
      return nil
    end
    return tonumber(last[2])
  end

  local function log_reset_after(l, s, now)
    local last = log_last_ts(l)
    if last == nil then
      return 0
    end
    return math.max(0, last + l.period - now)
  end

  ALG[4] = {
    load = function(l)
      return { sum = num(redis.call('HGET', l.keys[2], 'sum')) }
    end,
    -- used = sum minus the expired entries (ts + period <= now), which only a commit drops.
    live = function(l, s, now)
      local cutoff = now - l.period
      local expired = redis.call('ZRANGEBYSCORE', l.keys[1], '-inf', fmt(cutoff))
      local gone = 0
      for _, m in ipairs(expired) do
        gone = gone + entry_cost(m)
      end
      s.expired = #expired
      s.used = math.max(0, s.sum - gone)
      s.cutoff = cutoff
    end,
    check = function(l, s, now)
      ALG[4].live(l, s, now)
      if s.used + l.cost <= l.count then
        if l.cost > 0 then
          return 1, l.count - s.used - l.cost, l.period, 0
        end
        return 1, l.count - s.used, log_reset_after(l, s, now), 0
      end
      -- The request fits once the oldest `need` live units have expired.
      local need = s.used + l.cost - l.count
      local freed, offset, retry = 0, 0, nil
      while retry == nil do
        local page = redis.call('ZRANGEBYSCORE', l.keys[1], '(' .. fmt(s.cutoff), '+inf',
          'WITHSCORES', 'LIMIT', offset, 128)
        if #page == 0 then
          break
        end
        for i = 1, #page, 2 do
          freed = freed + entry_cost(page[i])
          if freed >= need then
            retry = math.max(0, tonumber(page[i + 1]) + l.period - now)
            break
          end
        end
        offset = offset + #page / 2
      end
      if retry == nil then
        -- Only for cost > count, which never fits: any positive answer is as good.
        retry = math.max(1, l.period)
      end
      return 0, math.max(0, l.count - s.used), log_reset_after(l, s, now), retry
    end,
    commit = function(l, s, now, floor_ms)
      if s.used == nil then
        ALG[4].live(l, s, now)
      end
      if s.expired > 0 then
        redis.call('ZREMRANGEBYSCORE', l.keys[1], '-inf', fmt(s.cutoff))
      end
      local sum = s.used
      local last = log_last_ts(l)
      if l.cost > 0 then
        -- Should the clock step back, the units are recorded at the later instant, which
        -- keeps timestamps ordered and errs towards limiting (as the Rust log does).
        local ts = now
        if last ~= nil and last > now then
          ts = last
        end
        local seq = redis.call('HINCRBY', l.keys[2], 'seq', 1)
        redis.call('ZADD', l.keys[1], fmt(ts), fmt(seq) .. ':' .. fmt(l.cost))
        sum = sum + l.cost
        last = ts
      end
      if last == nil then
        redis.call('DEL', l.keys[1], l.keys[2])
        return
      end
      redis.call('HSET', l.keys[2], 'sum', fmt(sum))
      expire(l.keys, last + l.period, now, floor_ms)
    end,
    peek = function(l, s, now)
      ALG[4].live(l, s, now)
      return math.max(0, l.count - s.used), log_reset_after(l, s, now)
    end,
    -- Removes one entry of this cost recorded at `at`: the request's own, or one
    -- indistinguishable from it. If the clock stepped back at the commit the entry sits later
    -- and is not found: the units stay taken, which errs towards limiting.
    refund = function(l, at, now, floor_ms)
      local offset = 0
      while true do
        local page = redis.call('ZRANGEBYSCORE', l.keys[1], fmt(at), fmt(at), 'LIMIT', offset, 128)
        if #page == 0 then
          return 0
        end
        for _, m in ipairs(page) do
          if entry_cost(m) == l.cost then
            redis.call('ZREM', l.keys[1], m)
            local sum = math.max(0, num(redis.call('HGET', l.keys[2], 'sum')) - l.cost)
            local last = log_last_ts(l)
            if last == nil then
              redis.call('DEL', l.keys[1], l.keys[2])
            else
              redis.call('HSET', l.keys[2], 'sum', fmt(sum))
              expire(l.keys, last + l.period, now, floor_ms)
            end
            return 1
          end
        end
        offset = offset + #page
      end
    end,
    -- The units recorded at `at` (the request's, merged with any others of that instant as the
    -- Rust log merges them) grow by delta, as a member of their own; or shrink by -delta, taken
    -- from that instant's members. An instant already expired changes nothing either way.
    settle = function(l, at, delta, now, floor_ms)
      if delta == 0 or at + l.period <= now then
        return 0
      end
      local sum = num(redis.call('HGET', l.keys[2], 'sum'))
      if delta > 0 then
        local seq = redis.call('HINCRBY', l.keys[2], 'seq', 1)
        redis.call('ZADD', l.keys[1], fmt(at), fmt(seq) .. ':' .. fmt(delta))
        sum = sum + delta
      else
        local left = -delta
        local members = redis.call('ZRANGEBYSCORE', l.keys[1], fmt(at), fmt(at))
        for _, m in ipairs(members) do
          if left == 0 then
            break
          end
          local c = entry_cost(m)
          local take = math.min(c, left)
          redis.call('ZREM', l.keys[1], m)
          if c > take then
            redis.call('ZADD', l.keys[1], fmt(at), string.match(m, '^(%d+):') .. ':' .. fmt(c - take))
          end
          left = left - take
          sum = math.max(0, sum - take)
        end
        if left == -delta then
          return 0
        end
      end
      local last = log_last_ts(l)
      if last == nil then
        redis.call('DEL', l.keys[1], l.keys[2])
        return 1
      end
      redis.call('HSET', l.keys[2], 'sum', fmt(sum))
      expire(l.keys, last + l.period, now, floor_ms)
      return 1
    end,
  }
end

-- concurrency ------------------------------------------------------------------------------
-- Slots are leases: the members of a sorted set, each a lease id scored by the instant (Redis
-- TIME) its lease runs out. The instance holding one renews it while its request runs
-- (renew.lua) and removes it when the request ends (release.lua); a member past its score
-- belongs to an instance that stopped renewing it (it died), and is no longer counted. Expired
-- members are trimmed by the commits and releases that write the key, and the key expires with
-- its last lease. A rejection's retry_after is the limit's own, which the caller fills in.

BUILD[6] = function()
  local function held(l, now)
    return redis.call('ZCOUNT', l.keys[1], '(' .. fmt(now), '+inf')
  end

  ALG[6] = {
    load = function(_)
      return {}
    end,
    check = function(l, _, now)
      local n = held(l, now)
      if n + l.cost <= l.count then
        return 1, l.count - n - l.cost, 0, 0
      end
      return 0, math.max(0, l.count - n), 0, 0
    end,
    commit = function(l, _, now, floor_ms)
      redis.call('ZREMRANGEBYSCORE', l.keys[1], '-inf', fmt(now))
      redis.call('ZADD', l.keys[1], fmt(now + l.period), fmt(l.burst))
      -- Every lease of the key has the same length, so the newest runs out last.
      redis.call('PEXPIRE', l.keys[1], math.max(1, fdiv(l.period + 999, 1000), floor_ms))
    end,
    peek = function(l, _, now)
      return math.max(0, l.count - held(l, now)), 0
    end,
    -- Cluster reserve-then-refund: the lease taken is removed.
    refund = function(l, _, _, _)
      return redis.call('ZREM', l.keys[1], fmt(l.burst))
    end,
  }
end

-- decisions --------------------------------------------------------------------------------

-- decide_many.lua's cache of gcra keys: the TAT each key has as the batch has left it so far
-- (0: none, as GET of a missing or deleted key reads), and for a key the batch charged, the
-- `now` and TTL floor of its last commit, written once at the end (gcra_flush) in the order
-- first charged; `states`, decide_limits' scratch list.
local function gcra_cache()
  return { tat = {}, now = {}, floor = {}, order = {}, states = {} }
end

-- Reads the TATs of `keys` (a list) into the cache in one MGET: one redis.call for a batch
-- instead of one GET per key. Keys the cache has already are left alone.
local function gcra_prefetch(cache, keys)
  local n = #keys
  if n == 0 then
    return
  end
  local values = redis.call('MGET', unpack(keys))
  local tats = cache.tat
  for i = 1, n do
    local key = keys[i]
    if tats[key] == nil then
      tats[key] = num(values[i])
    end
  end
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

-- One request's decision over `limits` at `now` (decide.lua documents the rule and the
-- reply): every limit is checked, and the ones that admitted are committed only if every
-- enforced one admitted. The 4 reply values per limit go into `out` after index `o`; returns
-- all_admitted (1|0: every enforced limit admitted). With
-- `cache` (decide_many.lua), gcra keys are read through it and written to it (gcra_cached
-- and gcra_defer above): the same arithmetic (gcra_check, which ALG[1] wraps) on the
-- state a call one at a time would have read; the other algorithms read and write their keys
-- as decide.lua does.
local function decide_limits(limits, now, floor_ms, out, o, cache)
  local all = 1
  local states = cache and cache.states or {}
  local n = #limits
  -- Numeric loops, not ipairs: an iterator is a function call per step.
  for i = 1, n do
    local l = limits[i]
    local admitted, remaining, reset_after, wait
    if cache and l.algo == 1 then
      local t, tau = l.t, l.tau
      if t == nil then
        t, tau = gcra_consts(l.count, l.period, l.burst)
      end
      local key = l.keys[1]
      local tat = cache.tat[key]
      if tat == nil then
        tat = gcra_cached(cache, key)
      end
      admitted, remaining, reset_after, wait, states[i] =
        gcra_check(tat, now, t, tau, l.cost, l.burst, l.max_delay)
    else
      local alg = ALG[l.algo]
      local s = alg.load(l)
      admitted, remaining, reset_after, wait = alg.check(l, s, now)
      states[i] = s
    end
    local r = o + (i - 1) * 4
    out[r + 1] = admitted
    out[r + 2] = remaining
    out[r + 3] = reset_after
    out[r + 4] = wait
    if admitted == 0 and not l.shadow then
      all = 0
    end
  end
  if all == 1 then
    for i = 1, n do
      if out[o + 1 + (i - 1) * 4] == 1 then
        local l = limits[i]
        if cache and l.algo == 1 then
          gcra_defer(cache, l.keys[1], states[i], now, floor_ms)
        else
          ALG[l.algo].commit(l, states[i], now, floor_ms)
        end
      end
    end
  end
  return all
end
