-- decide_gcra.lua: decide.lua for a request whose limits are all gcra, the common case.
-- Sent as `gcra.lua .. decide_gcra.lua .. lib.lua .. decide.lua`: when every limit is gcra
-- it answers and returns before lib.lua runs, so Redis does not build the library's closures
-- and tables, nor a table per limit, on such a call; otherwise it leaves the call to
-- decide.lua. Same ARGV, KEYS and reply as decide.lua, which documents them, and the same
-- decision (gcra.lua's gcra_decide).

do
  local n = tonumber(ARGV[3]) or 0
  if #KEYS == n and all_gcra(3, n) then
    -- Sized for one limit, the usual case: growing a table is an allocation and a copy.
    local out = { 1, 0, 0, 0, 0, 0 }
    gcra_decide(3, n, clock(ARGV[1]), tonumber(ARGV[2]) or 1, out)
    return out
  end
end
