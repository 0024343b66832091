#!/usr/bin/env bash
# bench/keyflood.sh — a key flood through a release gateway: resident memory against max_keys.
#
#   bench/keyflood.sh                         # 1M distinct keys, the default max_keys
#   KEYS=1000000 MAX_KEYS=100000 bench/keyflood.sh
#   KEYS=1000000 MAX_KEYS=1000000000 bench/keyflood.sh   # effectively no cap, for comparison
#
# One local limit keyed by `header:x-user` (gcra 100/1d: a key that took one unit is full again
# after 14.4 minutes, longer than the run); wrk sends every request with a new x-user value (a
# Lua counter), one request per key, until KEYS requests have been answered. Then: tollgate's VmRSS and VmHWM, the keys its stores
# hold and the evictions counted (/metrics), and requests/s over the flood. The upstream is an
# nginx worker as in bench/load.sh. Needs nginx, wrk, curl, python3; a release build
# (cargo build --release). bench/keymem.rs drives the store directly for 10M keys.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
KEYS="${KEYS:-1000000}"
MAX_KEYS="${MAX_KEYS:-}"
CONNECTIONS="${CONNECTIONS:-16}"
BIN="${TOLLGATE_BIN:-$REPO/target/release/tollgate}"
[[ -x "$BIN" ]] || { echo "keyflood.sh: $BIN missing: cargo build --release" >&2; exit 2; }
for tool in nginx wrk curl python3; do
    command -v "$tool" >/dev/null || { echo "keyflood.sh: $tool missing (apt-get install nginx wrk)" >&2; exit 2; }
done

NAME=keyflood
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"

UP=$(free_port)
mkdir -p "$TMP/up/tmp"/{client_body,proxy,fastcgi,uwsgi,scgi}
render upstream.nginx.conf "$TMP/up.conf" DIR="$TMP/up" PORT="$UP" USER_LINE="$(user_line)"
nginx -c "$TMP/up.conf" -g 'daemon off;' >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$UP/"

P=$(free_port); A=$(free_port)
{
    echo "server:"
    echo "  listen: 127.0.0.1:$P"
    echo "  admin: 127.0.0.1:$A"
    echo "  grace_period: 1s"
    [[ -n "$MAX_KEYS" ]] && echo "  max_keys: $MAX_KEYS"
    echo "routes:"
    echo "  - name: flood"
    echo "    match: {path_prefix: /}"
    echo "    upstream: http://127.0.0.1:$UP"
    echo "    limits:"
    echo "      - {name: per-user, key: [header:x-user], algorithm: gcra, rate: 100/1d, scope: local}"
} > "$TMP/flood.yaml"
"$BIN" check --config "$TMP/flood.yaml" | grep '^keys'
RUST_LOG=warn "$BIN" run --config "$TMP/flood.yaml" >"$TMP/tollgate.log" 2>&1 & tg=$!; PIDS+=("$tg")
wait_up "http://127.0.0.1:$A/healthz"

# Each wrk connection numbers its own keys: thread id, connection-independent counter.
cat > "$TMP/flood.lua" <<'LUA'
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/", { ["x-user"] = "flood-" .. n })
end
LUA

rss() { awk -v f="$1:" '$1 == f { print $2 * 1024 }' "/proc/$tg/status"; }
metric() { curl -s "http://127.0.0.1:$A/metrics" | awk -v s="$1" '$1 == s { print $2 }'; }
mib() { python3 -c "print(f'{$1 / 1048576:.1f}')"; }

before=$(rss VmRSS)
sent=0; secs=0; start=$(date +%s.%N)
# wrk runs for a time, not a count: runs of a few seconds until KEYS requests are done. wrk's
# Lua state is fresh per run, so each run's keys get a run prefix to stay distinct.
run=0
while (( sent < KEYS )); do
    run=$((run + 1))
    sed "s/\"flood-\"/\"flood-$run-\"/" "$TMP/flood.lua" > "$TMP/run.lua"
    out=$(wrk -t1 -c"$CONNECTIONS" -d5s -s "$TMP/run.lua" "http://127.0.0.1:$P/")
    sent=$(( sent + $(awk '/requests in/ {print $1}' <<<"$out") ))
done
end=$(date +%s.%N)
sleep 1.5 # one sweep: the metrics count what the flood evicted
after=$(rss VmRSS); peak=$(rss VmHWM)
held=$(metric 'tollgate_limit_keys{store="local"}')
evicted=$(metric 'tollgate_limit_keys_evicted_total{store="local"}')
cap=$(metric tollgate_limit_keys_max)
echo "keys sent     : $sent (distinct; $CONNECTIONS connections)"
echo "max_keys      : $cap"
echo "held, evicted : $held, $evicted"
echo "rss           : $(mib "$after") MiB (at start $(mib "$before") MiB), peak $(mib "$peak") MiB"
echo "bytes per key : $(python3 -c "print(round(($after - $before) / max($held, 1)))") (rss growth / keys held)"
echo "requests/s    : $(python3 -c "print(round($sent / ($end - $start)))")"
