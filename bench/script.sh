#!/usr/bin/env bash
# bench/script.sh — what one global decision costs Redis: decide.lua for one limit of each
# algorithm, timed by Redis itself.
#
#   bench/script.sh                    # ROUNDS=5 N=100000
#   BASE=<git rev> bench/script.sh     # the same, next to the scripts as of that revision
#   CALLGRIND=1 bench/script.sh        # instructions per EVALSHA instead (ROUNDS=1 N=20000)
#   CALLGRIND=1 PARTS=1 bench/script.sh  # and what the pieces of a script cost (see PARTS below)
#   FCALL=1 bench/script.sh            # also the function library: FCALL next to EVALSHA
#   CALLGRIND=1 FCALL=1 bench/script.sh  # the same in instructions per call
#   CALLGRIND=1 BATCH=1 bench/script.sh  # decide_many per decision at batch sizes (see below)
#
# BATCH=1 prices the batcher's call instead: `decide_many` (FCALL of the library, and its
# EVALSHA script) deciding m one-limit gcra requests per call, m = SIZES (default 1 8 64), for
# a hot key (all m on one key: one GET, one SET) and cold keys (m distinct keys, random per
# call through redis-benchmark's __rand_int__, so most are new), next to today's `decide` of
# one request (m = 1, `decide` rows). Figures are per decision: the call's figure / m. Each
# run sends N/m calls (at least 300), so every size decides about N requests.
#
# A fleet of gateways shares one Redis (or one per cluster slot), so the CPU Redis spends per
# EVALSHA is what bounds global decisions per second. For each algorithm this runs
# redis-benchmark (50 connections, unpipelined, on core 1) against a redis-server alone on
# core 0, sending EVALSHA of decide.lua with the arguments tollgate sends for one limit
# (1000000 per second, burst 1000000, cost 1, enforced, so every call admits and writes), and reads
# `usec_per_call` of EVALSHA from INFO commandstats: the time inside the command (the Lua and
# the commands it runs), without the network. Rounds are interleaved; medians are printed.
# With FCALL=1 the library tollgate loads on Redis >= 7 (bench/library_lua.sh) is loaded with
# FUNCTION LOAD, and each algorithm is also decided by `FCALL <library>_decide` with the same
# KEYS and ARGV (row `fcall`, figures from cmdstat_fcall), next to an empty function (`fempty`,
# what any FCALL costs): the library's top level ran once at load, not in these calls.
# With CALLGRIND=1, redis-server runs under valgrind's callgrind and each figure is the
# instructions it executed per EVALSHA (network included, pipelined 16 deep so the reads and
# writes are few): a count, not a time, so it does not move with the machine's load; one
# round is enough.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
LUA=src/limit/redis/lua
CALLGRIND="${CALLGRIND:-}"
ROUNDS="${ROUNDS:-$([[ -n $CALLGRIND ]] && echo 1 || echo 5)}"
N="${N:-$([[ -n $CALLGRIND ]] && echo 20000 || echo 100000)}"
for tool in redis-server redis-cli redis-benchmark taskset python3 ${CALLGRIND:+valgrind callgrind_control}; do
    command -v "$tool" >/dev/null || { echo "script.sh: $tool missing (apt-get install redis-server redis-tools)" >&2; exit 2; }
done

TMP="$(mktemp -d /tmp/tollgate-script.XXXXXX)"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
if [[ -n $CALLGRIND ]]; then
    taskset -c 0 valgrind --tool=callgrind --callgrind-out-file="$TMP/cg.out" \
        redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no >"$TMP/redis.log" 2>&1 &
else
    taskset -c 0 redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no >"$TMP/redis.log" 2>&1 &
fi
REDIS=$!
trap 'kill $REDIS 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$TMP"' EXIT
for _ in $(seq 300); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
cli() { redis-cli -p "$PORT" "$@"; }

# Script versions: this checkout, BASE's when given, and an empty script (`return 1`, with
# gcra's arguments only): the floor, what any EVALSHA costs before its Lua does anything.
VERSIONS=(here)
"$HERE/decide_lua.sh" >"$TMP/here.lua"
if [[ -n "${BASE:-}" ]]; then
    VERSIONS+=(base)
    "$HERE/decide_lua.sh" "$BASE" >"$TMP/base.lua"
fi
VERSIONS+=(empty)
echo "return 1" >"$TMP/empty.lua"
declare -A FN
if [[ -n "${FCALL:-}" ]]; then
    "$HERE/library_lua.sh" >"$TMP/library.lua"
    FN[fcall]="$(cli -x function load <"$TMP/library.lua")_decide"
    printf '#!lua name=bench_empty\nredis.register_function("bench_empty", function() return 1 end)\n' >"$TMP/fempty.lua"
    FN[fempty]="$(cli -x function load <"$TMP/fempty.lua")"
    [[ ${FN[fcall]} == tollgate_v*_decide && ${FN[fempty]} == bench_empty ]] ||
        { echo "script.sh: FUNCTION LOAD failed: ${FN[fcall]} ${FN[fempty]}" >&2; exit 1; }
    VERSIONS+=(fcall fempty)
fi
# PARTS=1: the top level of gcra.lua and lib.lua with nothing after it (what every call of
# refund.lua, peek.lua or a mixed decide.lua pays before its own work), and loops doing one
# thing 10 times (a `redis.call`, a `tonumber` of an argument, a two-field table, a µs
# timestamp through '%.0f' and through '%d'): (figure - empty) / 10 is one of them, the
# loop's few bytecodes included.
PARTS_10=()
if [[ -n "${PARTS:-}" ]]; then
    { cat "$REPO/$LUA/gcra.lua"; echo; cat "$REPO/$LUA/lib.lua"; echo; echo "return 1"; } >"$TMP/libtop.lua"
    echo "for i = 1, 10 do redis.call('TIME') end return 1" >"$TMP/call10.lua"
    echo "local x = 0 for i = 1, 10 do x = x + tonumber(ARGV[5]) end return 1" >"$TMP/num10.lua"
    echo "local t for i = 1, 10 do t = { x = i, y = i } end return 1" >"$TMP/table10.lua"
    echo "local s for i = 1, 10 do s = string.format('%.0f', 1795329886991672 + i) end return 1" >"$TMP/fmtf10.lua"
    echo "local s for i = 1, 10 do s = string.format('%d', 1795329886991672 + i) end return 1" >"$TMP/fmtd10.lua"
    PARTS_10=(call10 num10 table10 fmtf10 fmtd10)
    VERSIONS+=(libtop "${PARTS_10[@]}")
fi
declare -A SHA
for v in "${VERSIONS[@]}"; do [[ -n ${FN[$v]:-} ]] || SHA[$v]=$(cli -x script load <"$TMP/$v.lua"); done
# Versions decided for every algorithm; the others (floors, parts) run gcra's arguments only.
every_algorithm() { [[ $1 == here || $1 == base || $1 == fcall ]]; }

# Per algorithm: its code in ARGV and its keys (sliding_log has two).
ALGOS=(gcra fixed_window sliding_window sliding_log)
declare -A CODE=([gcra]=1 [fixed_window]=2 [sliding_window]=3 [sliding_log]=4)
declare -A KEYS=([gcra]="1 tg:{b}:gcra" [fixed_window]="1 tg:{b}:fw" [sliding_window]="1 tg:{b}:sw"
                 [sliding_log]="2 tg:{b}:log tg:{b}:logm")

UNIT=$([[ -n $CALLGRIND ]] && echo instr || echo µs)

# One redis-benchmark run of "$@" (the command and its arguments), -r for __rand_int__; the
# figure per call: instructions under callgrind, else usec_per_call of `stat`. Prints
# "<figure> <calls/s>".
bench_call() {
    local stat=$1 n=$2; shift 2
    cli flushall >/dev/null
    cli config resetstat >/dev/null
    local pipeline=() out us calls rps
    if [[ -n $CALLGRIND ]]; then
        callgrind_control -z "$REDIS" >/dev/null
        pipeline=(-P 16)
    fi
    out=$(taskset -c 1 redis-benchmark -p "$PORT" -c 50 -n "$n" -r 100000000 "${pipeline[@]}" -q "$@" 2>&1 | tr '\r' '\n' | tail -1)
    if [[ -n $CALLGRIND ]]; then
        rm -f "$TMP"/cg.out.*
        callgrind_control -d "$REDIS" >/dev/null
        for _ in $(seq 50); do compgen -G "$TMP/cg.out.*" >/dev/null && break; sleep 0.1; done
        calls=$(cli info commandstats | sed -n "s/^cmdstat_$stat:calls=\([0-9]*\).*/\1/p")
        us=$(awk -v c="$calls" '/^(summary|totals):/ {printf "%.0f", $2 / c; exit}' "$TMP"/cg.out.*)
    else
        us=$(cli info commandstats | sed -n "s/^cmdstat_$stat:.*usec_per_call=\([0-9.]*\).*/\1/p")
    fi
    rps=$(sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' <<<"$out")
    [[ -n "$us" && -n "$rps" ]] || { echo "script.sh: no figure for $*: $out" >&2; exit 1; }
    echo "$us $rps"
}

if [[ -n "${BATCH:-}" ]]; then
    SIZES="${SIZES:-1 8 64}"
    "$HERE/library_lua.sh" >"$TMP/library.lua"
    lib="$(cli -x function load <"$TMP/library.lua")"
    [[ $lib == tollgate_v* ]] || { echo "script.sh: FUNCTION LOAD failed: $lib" >&2; exit 1; }
    CONST=DECIDE_MANY_LUA "$HERE/decide_lua.sh" >"$TMP/many.lua"
    many_sha=$(cli -x script load <"$TMP/many.lua")
    one_sha=${SHA[here]}
    # One request's decide.lua ARGV: server clock, TTL floor 1, one gcra limit that admits.
    ONE=(-1 1 1 1 1000000 1000000 1000000 1 0 0)
    declare -A B
    rows=()
    for round in $(seq "$ROUNDS"); do
        for shape in hot cold; do
            key='tg:{b}:gcra'; [[ $shape == cold ]] && key='tg:{c__rand_int__}:gcra'
            for path in fcall evalsha; do
                if [[ $path == fcall ]]; then one=(fcall "${lib}_decide"); else one=(evalsha "$one_sha"); fi
                read -r us rps < <(bench_call "$path" "$N" "${one[@]}" 1 "$key" "${ONE[@]}")
                echo "round $round  $shape  decide  $path  m=1  ${us} $UNIT/decision  ${rps} calls/s"
                B[$shape.decide.$path.1]+="$us "
                for m in $SIZES; do
                    if [[ $path == fcall ]]; then cmd=(fcall "${lib}_decide_many"); else cmd=(evalsha "$many_sha"); fi
                    # decide_many's layout (lua/decide_many.lua), as batch.rs sends it: m, one
                    # limit spec, one shape (decide.lua's header and spec 1), m × shape 1.
                    keys=(); args=("$m" 1 "${ONE[@]:3}" 1 "${ONE[@]:0:3}" 1)
                    for _ in $(seq "$m"); do keys+=("$key"); args+=(1); done
                    calls=$(( N / m )); (( calls >= 300 )) || calls=300
                    read -r us rps < <(bench_call "$path" "$calls" "${cmd[@]}" "$m" "${keys[@]}" "${args[@]}")
                    per=$(awk -v u="$us" -v m="$m" 'BEGIN { printf "%.2f", u / m }')
                    echo "round $round  $shape  decide_many  $path  m=$m  ${per} $UNIT/decision  ${rps} calls/s"
                    B[$shape.many.$path.$m]+="$per "
                done
            done
        done
    done
    median() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
    echo
    echo "medians over $ROUNDS rounds, $UNIT per decision (redis-server on core 0${CALLGRIND:+ under callgrind}, redis-benchmark -c 50${CALLGRIND:+ -P 16} on core 1)"
    printf '%-6s %-8s %-12s %6s %14s\n' keys path call m "$UNIT/decision"
    for shape in hot cold; do
        for path in fcall evalsha; do
            printf '%-6s %-8s %-12s %6s %14s\n' "$shape" "$path" decide 1 "$(median "${B[$shape.decide.$path.1]}")"
            for m in $SIZES; do
                printf '%-6s %-8s %-12s %6s %14s\n' "$shape" "$path" decide_many "$m" "$(median "${B[$shape.many.$path.$m]}")"
            done
        done
    done
    exit 0
fi
declare -A US RPS
for round in $(seq "$ROUNDS"); do
    for a in "${ALGOS[@]}"; do
        for v in "${VERSIONS[@]}"; do
            every_algorithm "$v" || [[ $a == gcra ]] || continue
            if [[ -n ${FN[$v]:-} ]]; then
                cmd=(fcall "${FN[$v]}"); stat=fcall
            else
                cmd=(evalsha "${SHA[$v]}"); stat=evalsha
            fi
            cli flushall >/dev/null
            cli config resetstat >/dev/null
            if [[ -n $CALLGRIND ]]; then
                callgrind_control -z "$REDIS" >/dev/null
                pipeline=(-P 16)
            else
                pipeline=()
            fi
            # shellcheck disable=SC2086 # KEYS holds the key count and the keys
            out=$(taskset -c 1 redis-benchmark -p "$PORT" -c 50 -n "$N" "${pipeline[@]}" -q \
                "${cmd[@]}" ${KEYS[$a]} -1 1 1 "${CODE[$a]}" 1000000 1000000 1000000 1 0 0 2>&1 | tr '\r' '\n' | tail -1)
            if [[ -n $CALLGRIND ]]; then
                # Instructions since the zeroing, per call; the figure is in the µs column's place.
                rm -f "$TMP"/cg.out.*
                callgrind_control -d "$REDIS" >/dev/null
                for _ in $(seq 50); do compgen -G "$TMP/cg.out.*" >/dev/null && break; sleep 0.1; done
                calls=$(cli info commandstats | sed -n "s/^cmdstat_$stat:calls=\([0-9]*\).*/\1/p")
                us=$(awk -v c="$calls" '/^(summary|totals):/ {printf "%.0f", $2 / c; exit}' "$TMP"/cg.out.*)
            else
                us=$(cli info commandstats | sed -n "s/^cmdstat_$stat:.*usec_per_call=\([0-9.]*\).*/\1/p")
            fi
            rps=$(sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' <<<"$out")
            [[ -n "$us" && -n "$rps" ]] || { echo "script.sh: no figure for $a ($v): $out" >&2; exit 1; }
            echo "round $round  $a  $v  ${us} $UNIT/call  ${rps} calls/s"
            US[$a.$v]+="$us "
            RPS[$a.$v]+="$rps "
        done
    done
done

median() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
echo
echo "medians over $ROUNDS rounds (redis-server on core 0${CALLGRIND:+ under callgrind}, redis-benchmark -c 50${CALLGRIND:+ -P 16} on core 1, N=$N)"
printf '%-16s %-7s %12s %12s\n' algorithm script "$UNIT/call" "calls/s"
for a in "${ALGOS[@]}"; do
    for v in "${VERSIONS[@]}"; do
        every_algorithm "$v" || [[ $a == gcra ]] || continue
        label=$v; [[ $v == base ]] && label="$BASE"
        printf '%-16s %-7s %12s %12.0f\n' "$a" "${label:0:7}" "$(median "${US[$a.$v]}")" "$(median "${RPS[$a.$v]}")"
    done
done
if [[ ${#PARTS_10[@]} -gt 0 ]]; then
    empty=$(median "${US[gcra.empty]}")
    echo
    echo "one of each, (figure - empty) / 10, $UNIT:"
    for v in "${PARTS_10[@]}"; do
        awk -v v="$v" -v x="$(median "${US[gcra.$v]}")" -v e="$empty" 'BEGIN { printf "%-8s %10.0f\n", v, (x - e) / 10 }'
    done
    awk -v x="$(median "${US[gcra.libtop]}")" -v e="$empty" 'BEGIN { printf "gcra.lua + lib.lua top level: %.0f\n", x - e }'
fi
