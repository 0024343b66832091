#!/usr/bin/env bash
# bench/script.sh — what one global decision costs Redis: decide.lua for one limit of each
# algorithm, timed by Redis itself.
#
#   bench/script.sh                    # ROUNDS=5 N=100000
#   BASE=<git rev> bench/script.sh     # the same, next to the scripts as of that revision
#
# A fleet of gateways shares one Redis (or one per cluster slot), so the CPU Redis spends per
# EVALSHA is what bounds global decisions per second. For each algorithm this runs
# redis-benchmark (50 connections, unpipelined, on core 1) against a redis-server alone on
# core 0, sending EVALSHA of decide.lua with the arguments tollgate sends for one limit
# (1000000 per second, burst 1000000, cost 1, enforced, so every call admits and writes), and reads
# `usec_per_call` of EVALSHA from INFO commandstats: the time inside the command (the Lua and
# the commands it runs), without the network. Rounds are interleaved; medians are printed.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
LUA=src/limit/redis/lua
ROUNDS="${ROUNDS:-5}"
N="${N:-100000}"
for tool in redis-server redis-cli redis-benchmark taskset python3; do
    command -v "$tool" >/dev/null || { echo "script.sh: $tool missing (apt-get install redis-server redis-tools)" >&2; exit 2; }
done

TMP="$(mktemp -d /tmp/tollgate-script.XXXXXX)"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
taskset -c 0 redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no >"$TMP/redis.log" 2>&1 &
REDIS=$!
trap 'kill $REDIS 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$TMP"' EXIT
for _ in $(seq 50); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
cli() { redis-cli -p "$PORT" "$@"; }

# Script versions: this checkout, BASE's when given, and an empty script (`return 1`, with
# gcra's arguments only): the floor, what any EVALSHA costs before its Lua does anything.
VERSIONS=(here)
cat "$REPO/$LUA/lib.lua" <(echo) "$REPO/$LUA/decide.lua" >"$TMP/here.lua"
if [[ -n "${BASE:-}" ]]; then
    VERSIONS+=(base)
    { git -C "$REPO" show "$BASE:$LUA/lib.lua"; echo; git -C "$REPO" show "$BASE:$LUA/decide.lua"; } >"$TMP/base.lua"
fi
VERSIONS+=(empty)
echo "return 1" >"$TMP/empty.lua"
declare -A SHA
for v in "${VERSIONS[@]}"; do SHA[$v]=$(cli -x script load <"$TMP/$v.lua"); done

# Per algorithm: its code in ARGV and its keys (sliding_log has two).
ALGOS=(gcra fixed_window sliding_window sliding_log)
declare -A CODE=([gcra]=1 [fixed_window]=2 [sliding_window]=3 [sliding_log]=4)
declare -A KEYS=([gcra]="1 tg:{b}:gcra" [fixed_window]="1 tg:{b}:fw" [sliding_window]="1 tg:{b}:sw"
                 [sliding_log]="2 tg:{b}:log tg:{b}:logm")

declare -A US RPS
for round in $(seq "$ROUNDS"); do
    for a in "${ALGOS[@]}"; do
        for v in "${VERSIONS[@]}"; do
            [[ $v == empty && $a != gcra ]] && continue
            cli flushall >/dev/null
            cli config resetstat >/dev/null
            # shellcheck disable=SC2086 # KEYS holds the key count and the keys
            out=$(taskset -c 1 redis-benchmark -p "$PORT" -c 50 -n "$N" -q \
                evalsha "${SHA[$v]}" ${KEYS[$a]} -1 1 1 "${CODE[$a]}" 1000000 1000000 1000000 1 0 0 2>&1 | tr '\r' '\n' | tail -1)
            us=$(cli info commandstats | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p')
            rps=$(sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' <<<"$out")
            [[ -n "$us" && -n "$rps" ]] || { echo "script.sh: no figure for $a ($v): $out" >&2; exit 1; }
            echo "round $round  $a  $v  ${us} µs/call  ${rps} calls/s"
            US[$a.$v]+="$us "
            RPS[$a.$v]+="$rps "
        done
    done
done

median() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
echo
echo "medians over $ROUNDS rounds (redis-server on core 0, redis-benchmark -c 50 on core 1, N=$N)"
printf '%-16s %-6s %12s %12s\n' algorithm script "µs/EVALSHA" "EVALSHA/s"
for a in "${ALGOS[@]}"; do
    for v in "${VERSIONS[@]}"; do
        [[ $v == empty && $a != gcra ]] && continue
        label=$v; [[ $v == base ]] && label="$BASE"
        printf '%-16s %-6s %12s %12.0f\n' "$a" "${label:0:6}" "$(median "${US[$a.$v]}")" "$(median "${RPS[$a.$v]}")"
    done
done
