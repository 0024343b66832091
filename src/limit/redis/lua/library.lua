-- library.lua: the Redis function library (Redis >= 7: FUNCTION LOAD, FCALL) holding every
-- entry point of the EVALSHA scripts. Not loaded as written: script.rs replaces each line
-- `--@ <file>` with that file of this directory, and puts in front
--   #!lua name=<LIB>
--   local LIB = '<LIB>'
-- where LIB is `tollgate_v` and 12 hex digits of the SHA-1 of the expanded text below, so a
-- library that differs in one byte has another name, and two tollgate versions can both be
-- loaded (each calls its own functions) while a rollout runs. A library of this name already
-- on a node is this code: tollgate loads without REPLACE and takes "already exists" as done.
--
-- Redis runs a library's top level once, at FUNCTION LOAD: the helpers and the algorithms
-- (gcra.lua, lib.lua, whose closures lib.lua builds on first use and then keeps) are defined
-- there, and each FCALL runs only its function's body, the same body the EVALSHA script
-- runs after the same helpers. A function gets KEYS and ARGV as arguments rather than as
-- globals: it stores them in the two upvalues below, which the helpers read under those
-- names, so the included files are byte for byte the EVALSHA scripts' own. Redis runs one
-- function at a time, so the upvalues hold the running call's arguments.
--
-- Functions (LIB .. '_' .. name), with the KEYS, ARGV and reply of the script of that name:
--   decide     decide.lua (with decide_gcra.lua's all-gcra path first, as in the script)
--   decide_many  decide_many.lua: several requests' decisions in one call (the batcher's)
--   refund     refund.lua
--   peek       peek.lua (flagged no-writes: it never writes, and Redis may run it on a
--              read-only replica)
--   sync       sync.lua
--   sync_gcra  sync_gcra.lua
--   release    release.lua
--   renew      renew.lua
--   settle     settle.lua
--   reserve    reserve.lua

local KEYS, ARGV

-- A library has no setmetatable, which lib.lua uses to build each algorithm on its first use
-- (a saving for EVALSHA, where every call starts from nothing); here lib.lua's call is a no-op
-- and all six are built once, below.
local function setmetatable(t)
  return t
end

--@ gcra.lua
--@ lib.lua

for code = 1, 6 do
  BUILD[code](code)
end

local function decide(keys, args)
  KEYS, ARGV = keys, args
--@ decide_gcra.lua
--@ decide.lua
end

local function decide_many(keys, args)
  KEYS, ARGV = keys, args
--@ decide_many.lua
end

local function refund(keys, args)
  KEYS, ARGV = keys, args
--@ refund.lua
end

local function peek(keys, args)
  KEYS, ARGV = keys, args
--@ peek.lua
end

local function sync(keys, args)
  KEYS, ARGV = keys, args
--@ sync.lua
end

local function sync_gcra(keys, args)
  KEYS, ARGV = keys, args
--@ sync_gcra.lua
end

local function release(keys, args)
  KEYS, ARGV = keys, args
--@ release.lua
end

local function renew(keys, args)
  KEYS, ARGV = keys, args
--@ renew.lua
end

local function settle(keys, args)
  KEYS, ARGV = keys, args
--@ settle.lua
end

local function reserve(keys, args)
  KEYS, ARGV = keys, args
--@ reserve.lua
end

redis.register_function(LIB .. '_decide', decide)
redis.register_function(LIB .. '_decide_many', decide_many)
redis.register_function(LIB .. '_refund', refund)
redis.register_function{ function_name = LIB .. '_peek', callback = peek, flags = { 'no-writes' } }
redis.register_function(LIB .. '_sync', sync)
redis.register_function(LIB .. '_sync_gcra', sync_gcra)
redis.register_function(LIB .. '_release', release)
redis.register_function(LIB .. '_renew', renew)
redis.register_function(LIB .. '_settle', settle)
redis.register_function(LIB .. '_reserve', reserve)
