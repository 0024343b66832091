-- bench/load.sh target `tollgate global cold`: every request carries an X-User
-- header never sent before (a counter), so each global decision is on a new key.
-- The request is built with string concatenation rather than wrk.format, which
-- rebuilds the header table per request: wrk shares a core with the upstream
-- and redis-server, and its own cost per request moves the ratio.
local n = 0
local head = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-User: u"
request = function()
  n = n + 1
  return head .. n .. "\r\n\r\n"
end
