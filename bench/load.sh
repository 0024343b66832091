#!/usr/bin/env bash
# bench/load.sh — tollgate next to nginx, in one run, on one machine.
#
#   bench/load.sh            # DURATION=10 ROUNDS=3 CONNECTIONS=64
#   bench/load.sh --quick    # smoke run: DURATION=3 ROUNDS=1
#   DURATION=30 ROUNDS=5 CONNECTIONS=128 bench/load.sh
#
# Layout (2 cores):
#   core 0: the proxy under test, alone — nginx (1 worker) or tollgate
#           (TOKIO_WORKER_THREADS=1, RUST_LOG=warn);
#   core 1: the load generator (wrk -t1), the upstream (an nginx worker
#           answering `return 200 "ok\n"`) and redis-server (--save ''
#           --appendonly no) for the global limits.
# Targets: direct upstream, nginx proxy, tollgate proxy (no limits), tollgate
# admit (one local gcra limit that admits everything), tollgate reject (one
# local limit that answers 429 to everything after the first request);
# with Redis (REDIS=1, the default):
#   tollgate global admit: tollgate admit's limit with scope: global, redis
#     on_error: deny, pool_size 2; one key (the client IP) for every
#     connection, every request admitted: the hot key the batcher coalesces
#     (requests arriving while a call is in flight share the next call);
#   tollgate global reserved: tollgate global admit's limit with
#     reserve_ahead: 100ms: the hot key's units are reserved in Redis in
#     batches and spent in process (its burst is 100000 units smaller);
#   tollgate global cold: the same limit keyed by an X-User header that wrk
#     (bench/load/cold.lua) sets to a new value on every request: every
#     decision a different key, so none coalesce, but concurrent ones share a
#     call (decide_many);
#   tollgate global hot: a global gcra limit keyed by literal:hot (every wrk
#     connection is the same key), 100/1s burst 100: nearly every request is a
#     429, answered by the in-process tier in front of Redis;
#   redis-bench EVALSHA (and -P16): the ceiling — `redis-benchmark -c 50`
#     (and pipelined, -P 16) sending EVALSHA of the same decide script with the
#     same arguments, on core 1 next to redis-server.
# Redis commands are read from `INFO commandstats` just before and after each
# run: EVALSHA/EVAL/SCRIPT calls are the gateway's round trips; the GET/TIME/SET
# that the script runs inside Redis are reported separately.
# The whole sequence runs ROUNDS times (interleaved, so drift hits every target
# alike; tollgate proxy and admit swap places every other round); each figure is
# the median over rounds, and admit / proxy is also given paired by round. The
# output is meant to be pasted into the README as it is.
#
# Environment knobs:
#   DURATION=10      seconds per wrk run
#   ROUNDS=3         interleaved rounds
#   CONNECTIONS=64   wrk connections
#   WARMUP=2         seconds of wrk per target before round 1 (0: none)
#   PROXY_CPU=0 LOAD_CPU=1   cores for the proxy under test / for wrk + upstream
#   TOLLGATE_BIN=... use this binary instead of target/release/tollgate (no build)
#   KEEP=1           keep the temp dir (configs, logs, raw wrk output)
#   WAIT_QUIET=20    before each run, wait up to this many seconds for both
#                    cores to be idle (< QUIET_BUSY=15 % busy): on a shared box
#                    a compiler on core 0 skews the comparison (0: don't wait)
#   MAX_OTHER=10 RETRIES=2   a run during which other processes took more than
#                    MAX_OTHER % CPU is made again, RETRIES times at most
#   BUILD_TIMEOUT=1800  seconds allowed for `cargo build --release`
#   REDIS=1          0: skip redis-server and every Redis target
#
# Exit status: 0 every goal PASS; 1 a goal FAILed (the measurement itself is
# sound); 2 the measurement is not sound (a sanity check failed, a server did
# not start, a tool is missing).
#
# Structure: one start_* function per server, one target_* function per wrk
# target (see TARGETS).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
TEMPLATES="$HERE/load"
INVOKED="bench/load.sh${*:+ $*}"

usage() { sed -n '2,/^set -E/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "load.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
if (( QUICK )); then
    DURATION="${DURATION:-3}"; ROUNDS="${ROUNDS:-1}"; WARMUP="${WARMUP:-1}"
fi
DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-3}"
CONNECTIONS="${CONNECTIONS:-64}"
WARMUP="${WARMUP:-2}"
PROXY_CPU="${PROXY_CPU:-0}"
LOAD_CPU="${LOAD_CPU:-1}"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-1800}"
KEEP="${KEEP:-0}"
WAIT_QUIET="${WAIT_QUIET:-20}"
QUIET_BUSY="${QUIET_BUSY:-15}"
MAX_OTHER="${MAX_OTHER:-10}"
RETRIES="${RETRIES:-2}"
REDIS="${REDIS:-1}"
for v in DURATION ROUNDS CONNECTIONS WARMUP PROXY_CPU LOAD_CPU BUILD_TIMEOUT WAIT_QUIET QUIET_BUSY MAX_OTHER RETRIES; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "load.sh: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
(( DURATION > 0 && ROUNDS > 0 && CONNECTIONS > 0 )) || { echo "load.sh: DURATION, ROUNDS, CONNECTIONS must be > 0" >&2; exit 2; }
[[ "$REDIS" == 0 || "$REDIS" == 1 ]] || { echo "load.sh: REDIS must be 0 or 1, got '$REDIS'" >&2; exit 2; }

# The targets, in the order every round runs them. A target is one name here,
# one target_* function and (for a new server) one start_* function. Targets
# named rb-* are redis-benchmark runs, every other one a wrk run.
TARGETS=(direct nginx tg-proxy tg-admit tg-reject)
(( REDIS )) && TARGETS+=(tg-global-admit tg-global-reserved tg-global-cold tg-global-hot rb-evalsha rb-evalsha-p16)
declare -A LABEL=(
    [direct]="direct upstream"
    [nginx]="nginx proxy"
    [tg-proxy]="tollgate proxy"
    [tg-admit]="tollgate admit"
    [tg-reject]="tollgate reject"
    [tg-global-admit]="tollgate global admit"
    [tg-global-reserved]="tollgate global reserved"
    [tg-global-hot]="tollgate global hot"
    [tg-global-cold]="tollgate global cold"
    [rb-evalsha]="redis-bench EVALSHA"
    [rb-evalsha-p16]="redis-bench EVALSHA -P16"
    [redis]="redis-server"
)
# The redis-benchmark targets: connections and pipeline depth.
RB_CLIENTS=50
declare -A RB_PIPELINE=([rb-evalsha]=1 [rb-evalsha-p16]=16)
# tollgate global hot's quota (bench/load/tollgate-global-hot.yaml), for the
# check that the global limit really limits.
HOT_RATE=100 HOT_BURST=100
# The ceiling's arguments: decide.lua's ARGV (see its header comment): now
# (-1 = Redis's TIME), TTL floor (ms), n = 1 limit, then that limit: algo 1
# (gcra), count, period (µs), burst, cost, max_delay, shadow — tollgate admit's
# limit (1000000/1s, burst 1000000, cost 1, reject, enforced). One key, as tollgate global
# admit's `ip` key is one key for every wrk connection (all from 127.0.0.1).
RB_KEY='tg:{bench/ceiling/127.0.0.1}:gcra'
RB_ARGV=(-1 1 1 1 1000000 1000000 1000000 1 0 0)

HARNESS=load.sh
# shellcheck source=bench/harness.sh
source "$HERE/harness.sh"

# ---------------------------------------------------------------- tools
ensure_tools() {
    local missing=() cmd pkg pairs=(wrk:wrk nginx:nginx taskset:util-linux curl:curl python3:python3)
    (( REDIS )) && pairs+=(redis-server:redis-server redis-cli:redis-tools redis-benchmark:redis-tools sha1sum:coreutils)
    for pair in "${pairs[@]}"; do
        cmd="${pair%%:*}"; pkg="${pair#*:}"
        command -v "$cmd" >/dev/null || [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
    done
    (( ${#missing[@]} == 0 )) && return 0
    if (( EUID == 0 )) && command -v apt-get >/dev/null; then
        log "installing: ${missing[*]}"
        timeout 600 apt-get update -qq >&2 || true
        DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "${missing[@]}" >&2 \
            || die "apt-get install ${missing[*]} failed"
    else
        die "missing: ${missing[*]} (run as root to install them, or install them yourself)"
    fi
}

# ---------------------------------------------------------------- tollgate binary
ensure_tollgate() {
    if [[ -n "${TOLLGATE_BIN:-}" ]]; then
        [[ -x "$TOLLGATE_BIN" ]] || die "TOLLGATE_BIN=$TOLLGATE_BIN is not executable"
        return 0
    fi
    # The repo's own target dir (or the caller's CARGO_TARGET_DIR).
    local target_dir="${CARGO_TARGET_DIR:-$REPO/target}"
    TOLLGATE_BIN="$target_dir/release/tollgate"
    local stale=""
    if [[ ! -x "$TOLLGATE_BIN" ]]; then
        stale="no release binary"
    else
        stale="$(find "$REPO/src" "$REPO/Cargo.toml" "$REPO/Cargo.lock" -newer "$TOLLGATE_BIN" -print -quit 2>/dev/null || true)"
        [[ -n "$stale" ]] && stale="$stale is newer than the binary"
    fi
    if [[ -n "$stale" ]]; then
        command -v cargo >/dev/null || die "$stale, and no cargo to build it"
        # cargo waits by itself if another cargo holds the build lock.
        log "building: cargo build --release ($stale)"
        (cd "$REPO" && timeout --foreground "$BUILD_TIMEOUT" cargo build --release --bin tollgate) >&2 \
            || die "cargo build --release failed"
        [[ -x "$TOLLGATE_BIN" ]] || die "no $TOLLGATE_BIN after the build"
    fi
}

# ---------------------------------------------------------------- helpers
# free_ports N: N distinct free TCP ports on 127.0.0.1 (held open together
# while picking, so they are distinct).
free_ports() {
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# render TEMPLATE OUT NAME=VALUE...: copy a template, filling @NAME@ placeholders.
render() {
    local src="$TEMPLATES/$1" out="$2"; shift 2
    [[ -f "$src" ]] || die "template $src missing"
    local script=() kv
    for kv in "$@"; do script+=(-e "s|@${kv%%=*}@|${kv#*=}|g"); done
    sed "${script[@]}" "$src" > "$out"
    if grep -q '@[A-Z_]*@' "$out"; then die "unfilled placeholder in $out: $(grep -o '@[A-Z_]*@' "$out" | head -1)"; fi
}

# http_status URL: the status code, or 000 if nothing answers.
http_status() { curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null || true; }

# wait_http NAME PID URL [EXPECTED...]: wait (10 s at most) until URL answers.
wait_http() {
    local name="$1" pid="$2" url="$3"; shift 3
    local want=("${@:-200}") code="" deadline=$((SECONDS + 10))
    while (( SECONDS < deadline )); do
        kill -0 "$pid" 2>/dev/null || die "$name exited during startup; its log: $(tail -5 "$TMP/$name.log" 2>/dev/null)"
        code="$(http_status "$url")"
        for w in "${want[@]}"; do [[ "$code" == "$w" ]] && return 0; done
        sleep 0.1
    done
    die "$name did not answer $url with ${want[*]} within 10s (last: $code); log: $(tail -5 "$TMP/$name.log" 2>/dev/null)"
}

# spawn NAME CPU CMD...: start CMD pinned to CPU, in the background, output to
# $TMP/NAME.log. `env` and `taskset` exec, so $! is the server's own pid.
spawn() {
    local name="$1" cpu="$2"; shift 2
    taskset -c "$cpu" "$@" > "$TMP/$name.log" 2>&1 < /dev/null &
    SPAWNED=$!
    PIDS+=("$SPAWNED")
}

nginx_user_line() { if (( EUID == 0 )); then echo "user root;"; else echo ""; fi; }

# start_nginx NAME CPU TEMPLATE PORT [NAME=VALUE...]: an nginx in its own prefix dir.
start_nginx() {
    local name="$1" cpu="$2" tmpl="$3" port="$4"; shift 4
    local dir="$TMP/$name"
    mkdir -p "$dir/tmp" "$dir/logs"
    render "$tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" USER_LINE="$(nginx_user_line)" "$@"
    local eflag=()
    nginx -h 2>&1 | grep -q -- '-e filename' && eflag=(-e "$dir/error.log")
    nginx -p "$dir/" -c "$dir/nginx.conf" "${eflag[@]}" -t > "$TMP/$name.log" 2>&1 \
        || die "nginx -t for $name: $(cat "$TMP/$name.log")"
    spawn "$name" "$cpu" nginx -p "$dir/" -c "$dir/nginx.conf" "${eflag[@]}" -g 'daemon off;'
}

# ---------------------------------------------------------------- servers
# Ports, filled in by main.
declare -A PORT

start_upstream() {
    start_nginx upstream "$LOAD_CPU" upstream.nginx.conf "${PORT[upstream]}"
    PID_UPSTREAM=$SPAWNED
    wait_http upstream "$PID_UPSTREAM" "http://127.0.0.1:${PORT[upstream]}/"
}

start_nginx_proxy() {
    start_nginx nginx "$PROXY_CPU" proxy.nginx.conf "${PORT[nginx]}" UPSTREAM_PORT="${PORT[upstream]}"
    PID_NGINX=$SPAWNED
    wait_http nginx "$PID_NGINX" "http://127.0.0.1:${PORT[nginx]}/"
}

# start_tollgate NAME: tollgate with bench/load/tollgate-NAME.yaml
# (NAME = proxy|admit|reject|global-admit|global-reserved|global-cold|global-hot).
declare -A TG_PID
start_tollgate() {
    local name="$1" key="tg-$1"
    local cfg="$TMP/tollgate-$name.yaml"
    render "tollgate-$name.yaml" "$cfg" PORT="${PORT[$key]}" ADMIN_PORT="${PORT[$key-admin]}" UPSTREAM_PORT="${PORT[upstream]}" \
        REDIS_PORT="${PORT[redis]:-}"
    "$TOLLGATE_BIN" check --config "$cfg" > "$TMP/$key.check" 2>&1 || die "tollgate check $cfg: $(cat "$TMP/$key.check")"
    spawn "$key" "$PROXY_CPU" env TOKIO_WORKER_THREADS=1 RUST_LOG=warn "$TOLLGATE_BIN" run --config "$cfg"
    TG_PID[$name]=$SPAWNED
    wait_http "$key" "$SPAWNED" "http://127.0.0.1:${PORT[$key-admin]}/healthz"
}

# start_redis PORT: a throwaway redis-server (no persistence) on the load core,
# for the Redis-backed targets.
start_redis() {
    local port="$1"
    command -v redis-server >/dev/null || {
        (( EUID == 0 )) && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq redis-server >&2
    } || die "redis-server missing"
    mkdir -p "$TMP/redis"
    spawn redis "$LOAD_CPU" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP/redis"
    PID_REDIS=$SPAWNED
    local deadline=$((SECONDS + 10))
    until [[ "$(redis-cli -p "$port" ping 2>/dev/null)" == PONG ]]; do
        kill -0 "$PID_REDIS" 2>/dev/null || die "redis-server exited: $(tail -5 "$TMP/redis.log")"
        (( SECONDS < deadline )) || die "redis-server did not answer PING within 10s"
        sleep 0.1
    done
}

# ---------------------------------------------------------------- measurement
CLK_TCK="$(getconf CLK_TCK)"

# cpu_ticks PID...: utime+stime of these processes (clock ticks).
cpu_ticks() {
    local t=0 pid f
    for pid in "$@"; do
        [[ -r "/proc/$pid/stat" ]] || continue
        f="$(sed 's/.*) //' "/proc/$pid/stat")"   # fields from 3 (state) on
        set -- $f
        t=$((t + ${12} + ${13}))                 # fields 14, 15
    done
    echo "$t"
}

# core_sample: "busy0 total0 busy1 total1 work" for PROXY_CPU and LOAD_CPU from
# /proc/stat; busy = not idle, work = user + nice + system + irq + softirq of
# both cores (tick accounting charges a tick spent in softirq to the task it
# interrupted as well, so softirq belongs with the tasks' own times).
core_sample() {
    awk -v a="cpu$PROXY_CPU" -v b="cpu$LOAD_CPU" '
        $1 == a || $1 == b { tot = 0; for (i = 2; i <= 9; i++) tot += $i; r[$1] = (tot - $5 - $6) " " tot; w += $2 + $3 + $4 + $7 + $8 }
        END { print r[a], r[b], w }' /proc/stat
}

# wait_quiet: wait (WAIT_QUIET s at most) until both cores are idle.
wait_quiet() {
    (( WAIT_QUIET > 0 )) || return 0
    local deadline=$((SECONDS + WAIT_QUIET)) a b busy
    while :; do
        a="$(core_sample)"; sleep 0.5; b="$(core_sample)"
        busy="$(awk -v c0="$a" -v c1="$b" 'BEGIN { split(c0, x, " "); split(c1, y, " ")
            d0 = y[2] - x[2]; d1 = y[4] - x[4]
            b0 = d0 ? (y[1] - x[1]) / d0 * 100 : 0; b1 = d1 ? (y[3] - x[3]) / d1 * 100 : 0
            printf "%.0f", (b0 > b1 ? b0 : b1) }')"
        (( busy < QUIET_BUSY )) && return 0
        if (( SECONDS >= deadline )); then
            log "warning: a core is still ${busy}% busy with other work after ${WAIT_QUIET}s; measuring anyway"
            return 0
        fi
    done
}

# Server processes whose CPU is reported for a target (nginx: master + workers;
# the redis-benchmark targets: redis-server).
server_pids() {
    local pid
    case "$1" in
        direct) pid=$PID_UPSTREAM ;;
        nginx) pid=$PID_NGINX ;;
        tg-*) pid=${TG_PID[${1#tg-}]} ;;
        redis|rb-*) pid=$PID_REDIS ;;
    esac
    echo "$pid" $(pgrep -P "$pid" 2>/dev/null || true)
}

target_url() { echo "http://127.0.0.1:${PORT[$1]}/"; }

# One function per target: how to make sure it is up before a run. A target
# whose server died makes the whole measurement unsound.
target_alive() {
    local pids; pids="$(server_pids "$1")"
    local p; for p in $pids; do kill -0 "$p" 2>/dev/null || die "${LABEL[$1]} (pid $p) is gone; log: $(tail -5 "$TMP/$1.log" 2>/dev/null)"; done
}
target_direct()    { target_alive direct; }
target_nginx()     { target_alive nginx; target_alive direct; }
target_tg-proxy()  { target_alive tg-proxy; target_alive direct; }
target_tg-admit()  { target_alive tg-admit; target_alive direct; }
target_tg-reject() { target_alive tg-reject; }
target_tg-global-admit() { target_alive tg-global-admit; target_alive redis; target_alive direct; }
target_tg-global-reserved() { target_alive tg-global-reserved; target_alive redis; target_alive direct; }
target_tg-global-hot()   { target_alive tg-global-hot; target_alive redis; target_alive direct; }
target_tg-global-cold()  { target_alive tg-global-cold; target_alive redis; target_alive direct; }
target_rb-evalsha()      { target_alive redis; }
target_rb-evalsha-p16()  { target_alive redis; }

# ---------------------------------------------------------------- redis
rcli() { redis-cli -h 127.0.0.1 -p "${PORT[redis]}" "$@"; }

# redis_stats: "round_trips other failed" from INFO commandstats (cumulative):
# round_trips = EVALSHA/EVAL/SCRIPT calls (what a client sends to decide);
# other = every other command but INFO, i.e. mostly the GET/TIME/SET the
# script runs inside Redis (commandstats counts those too), and PINGs;
# failed = failed_calls + rejected_calls of every command (a NOSCRIPT, a
# script error). "0 0 0" without Redis.
redis_stats() {
    if (( ! REDIS )); then echo "0 0 0"; return 0; fi
    local info; info="$(rcli INFO commandstats 2>&1)" || die "redis-cli INFO commandstats: $info"
    tr -d '\r' <<< "$info" | awk -F'[:,=]' '
        /^cmdstat_/ {
            name = substr($1, 9); calls = 0
            for (i = 2; i < NF; i += 2) {
                if ($i == "calls") calls = $(i + 1)
                if ($i == "failed_calls" || $i == "rejected_calls") bad += $(i + 1)
            }
            if (name == "info") next
            if (name ~ /^(evalsha|evalsha_ro|eval|eval_ro|fcall|fcall_ro|script\||function\|)/) rt += calls; else other += calls
        }
        END { printf "%d %d %d\n", rt, other, bad }'
}

# tg_metrics TARGET: "tier_redis tier_in_process tier_fallback redis_errors
# status_429 status_503" from a tollgate's /metrics (cumulative); zeros for a
# target that is not a global-limit tollgate.
tg_metrics() {
    if [[ "$1" != tg-global-* ]]; then echo "0 0 0 0 0 0"; return 0; fi
    # Classic text has no end marker: curl -f fails on an error status or a cut-short body.
    local m; m="$(curl -sf -m 5 "http://127.0.0.1:${PORT[$1-admin]}/metrics")" \
        || die "no /metrics from ${LABEL[$1]}"
    awk '
        /^tollgate_limiter_tier_decisions_total\{/ && /scope="global"/ {
            if (/tier="redis"/) r += $NF; else if (/tier="in_process"/) ip += $NF; else if (/tier="fallback"/) fb += $NF
        }
        /^tollgate_redis_errors_total\{/ { e += $NF }
        /^tollgate_requests_total\{/ { if (/status="429"/) s429 += $NF; if (/status="503"/) s503 += $NF }
        END { printf "%d %d %d %d %d %d\n", r, ip, fb, e, s429, s503 }' <<< "$m"
}

# tg_redis_errors TARGET: tollgate_redis_errors_total by kind, "kind=N ...".
tg_redis_errors() {
    curl -s -m 5 "http://127.0.0.1:${PORT[$1-admin]}/metrics" \
        | awk -F'[{}"]' '/^tollgate_redis_errors_total\{/ { n = split($0, f, " "); print $3 "=" f[n] }' | sort | paste -sd' ' -
}

# The decide script exactly as tollgate sends it (bench/decide_lua.sh reads script.rs's
# DECIDE_LUA). Same bytes, same SHA.
DECIDE_SHA=""
prepare_ceiling() {
    local lua="$TMP/decide-full.lua"
    "$REPO/bench/decide_lua.sh" > "$lua"
    DECIDE_SHA="$(sha1sum "$lua" | cut -d' ' -f1)"
    # tollgate global admit has decided a request by now, so tollgate loaded
    # its function library (Redis >= 7): it must be this checkout's, whose
    # decide function runs decide.lua's code.
    local lib had; lib="$("$REPO/bench/library_lua.sh" | sed -n '1s/^#!lua name=//p')"
    had="$(rcli FUNCTION LIST LIBRARYNAME "$lib" 2>&1 | grep -cx "$lib" || true)"
    [[ "$had" -ge 1 ]] || die "Redis has no function library $lib after tollgate's first decision: the harness's copy of the Lua is not what tollgate sends"
    local sha; sha="$(rcli -x SCRIPT LOAD < "$lua" 2>&1)"
    [[ "$sha" == "$DECIDE_SHA" ]] || die "SCRIPT LOAD answered '$sha', expected $DECIDE_SHA"
    # One decision on a fresh key: a full bucket admits (1), at Redis's clock,
    # leaving burst - cost, with no delay.
    rcli DEL "$RB_KEY" > /dev/null
    local reply now_us
    now_us="$(date +%s%6N)"
    reply="$(rcli EVALSHA "$DECIDE_SHA" 1 "$RB_KEY" "${RB_ARGV[@]}" 2>&1 | tr '\n' ' ')"
    awk -v now="$now_us" -v burst="${RB_ARGV[6]}" -v cost="${RB_ARGV[7]}" '{
            ok = NF == 6 && $1 == 1 && $3 == 1 && $4 == burst - cost && $6 == 0 && $2 > now - 5e6 && $2 < now + 5e6
            exit !ok }' <<< "$reply" \
        || die "EVALSHA $DECIDE_SHA 1 $RB_KEY ${RB_ARGV[*]} answered '$reply', not an admitted decision (1 NOW 1 $(( RB_ARGV[6] - RB_ARGV[7] )) RESET 0)"
    CEILING_CHECK="EVALSHA $DECIDE_SHA (= tollgate's decide script; its library $lib was loaded by tollgate) 1 $RB_KEY ${RB_ARGV[*]} -> [ ${reply% }]: admitted, remaining burst-1"
    rcli DEL "$RB_KEY" > /dev/null
}

# redis-benchmark requests/s per target: a first guess, then what the warm-up
# measured; a run sends RB_RATE x seconds requests (redis-benchmark has no -d).
declare -A RB_RATE=([rb-evalsha]=30000 [rb-evalsha-p16]=60000)
rb_requests() { awk -v r="${RB_RATE[$1]}" -v s="$2" 'BEGIN { n = int(r * s); print (n < 10000 ? 10000 : n) }'; }

# run_target TARGET SECONDS OUTFILE: one run of the load tool (wrk, or
# redis-benchmark for rb-*) against TARGET; writes the tool's output to
# OUTFILE and prints
#   "srv% core0% core1% other% redis% rt other_cmds failed tier_redis
#    tier_in_process tier_fallback redis_errors 429s 503s"
# for the run. other% is the CPU the two cores spent running processes other
# than ours (server, upstream, redis-server, load tool): what the rest of the
# machine took from the measurement. redis% is redis-server's CPU. The
# remaining fields are the deltas of redis_stats and tg_metrics over the run.
run_target() {
    local target="$1" secs="$2" out="$3"
    "target_$target"
    wait_quiet
    local pids aux="" rpids=""
    pids="$(server_pids "$target")"
    [[ "$target" == direct ]] || aux+=" $(server_pids direct)"
    if (( REDIS )); then
        rpids="$(server_pids redis)"
        [[ "$target" == rb-* ]] || aux+=" $rpids"
    fi
    local load=() ltimeout
    if [[ "$target" == rb-* ]]; then
        local n; n="$(rb_requests "$target" "$secs")"
        echo "$n" > "$out.n"
        load=(redis-benchmark -h 127.0.0.1 -p "${PORT[redis]}" -c "$RB_CLIENTS" -n "$n" -P "${RB_PIPELINE[$target]}" --csv
              EVALSHA "$DECIDE_SHA" 1 "$RB_KEY" "${RB_ARGV[@]}")
        ltimeout=$((secs * 4 + 30))
    else
        load=(wrk -t1 -c"$CONNECTIONS" -d"${secs}s" --latency)
        # A new X-User (the limit's key) on every request.
        [[ "$target" == tg-global-cold ]] && load+=(-s "$TEMPLATES/cold.lua")
        load+=("$(target_url "$target")")
        ltimeout=$((secs + 30))
    fi
    local rs0 rs1 m0 m1
    rs0="$(redis_stats)"; m0="$(tg_metrics "$target")"
    local t0 u0 r0 c0 c1 t1 u1 r1 ns0 ns1
    t0="$(cpu_ticks $pids)"; u0="$(cpu_ticks $aux)"; r0="$(cpu_ticks $rpids)"; c0="$(core_sample)"; ns0="$(date +%s%N)"
    # bash -c ... times: the load tool's own CPU time, from the shell that waited for it.
    timeout --foreground "$ltimeout" taskset -c "$LOAD_CPU" bash -c \
        '"${@:2}"; rc=$?; times > "$1"; exit $rc' _ "$out.times" "${load[@]}" > "$out" 2>&1 \
        || die "${load[0]} against ${LABEL[$target]} failed: $(tail -3 "$out")"
    ns1="$(date +%s%N)"; c1="$(core_sample)"; t1="$(cpu_ticks $pids)"; u1="$(cpu_ticks $aux)"; r1="$(cpu_ticks $rpids)"
    rs1="$(redis_stats)"; m1="$(tg_metrics "$target")"
    awk -v t0="$t0" -v t1="$t1" -v u="$((u1 - u0))" -v rd="$((r1 - r0))" -v hz="$CLK_TCK" -v ns=$((ns1 - ns0)) -v c0="$c0" -v c1="$c1" \
        -v rs0="$rs0" -v rs1="$rs1" -v m0="$m0" -v m1="$m1" '
        function secs(v,   m) { m = index(v, "m"); return substr(v, 1, m - 1) * 60 + substr(v, m + 1, length(v) - m - 1) }
        NR == 2 { tool = secs($1) + secs($2) }
        END {
            split(c0, a, " "); split(c1, b, " "); el = ns / 1e9
            srv = (t1 - t0) / hz / el * 100
            k0 = (b[2] - a[2]) ? (b[1] - a[1]) / (b[2] - a[2]) * 100 : 0
            k1 = (b[4] - a[4]) ? (b[3] - a[3]) / (b[4] - a[4]) * 100 : 0
            other = ((b[5] - a[5]) - (t1 - t0) - u) / hz - tool
            printf "%.0f %.0f %.0f %.0f %.0f", srv, k0, k1, (other > 0 ? other : 0) / el * 100, rd / hz / el * 100
            n = split(rs0, x, " "); split(rs1, y, " "); for (i = 1; i <= n; i++) printf " %d", y[i] - x[i]
            n = split(m0, x, " "); split(m1, y, " "); for (i = 1; i <= n; i++) printf " %d", y[i] - x[i]
            printf "\n"
        }' "$out.times"
}

# parse_rb FILE: parse_wrk's fields from redis-benchmark --csv output:
# "rps p50_ms p99_ms requests 0 0" (errors show in redis_stats' failed).
parse_rb() {
    local n; n="$(cat "$1.n" 2>/dev/null)" || return 1
    awk -F'","' -v n="$n" '
        /^"test","rps"/ { next }
        NF == 8 && /^"/ { gsub(/"/, "", $2); gsub(/"/, "", $8); rps = $2; p50 = $5; p99 = $7 }
        END {
            if (rps == "" || rps + 0 <= 0) exit 1
            printf "%.2f %.3f %.3f %d 0 0\n", rps, p50, p99, n
        }' "$1"
}

# parse_target TARGET FILE: "rps p50_ms p99_ms requests non2xx socket_errors"
parse_target() { if [[ "$1" == rb-* ]]; then parse_rb "$2"; else parse_wrk "$2"; fi; }

# parse_wrk FILE: "rps p50_ms p99_ms requests non2xx socket_errors"
parse_wrk() {
    awk '
        function ms(v) {
            if (v ~ /us$/) return substr(v, 1, length(v) - 2) / 1000
            if (v ~ /ms$/) return substr(v, 1, length(v) - 2) + 0
            if (v ~ /m$/)  return substr(v, 1, length(v) - 1) * 60000
            if (v ~ /s$/)  return substr(v, 1, length(v) - 1) * 1000
            return v + 0
        }
        $1 == "50%" { p50 = ms($2) }
        $1 == "99%" { p99 = ms($2) }
        / requests in / { reqs = $1 }
        /^Requests\/sec:/ { rps = $2 }
        /Non-2xx or 3xx responses:/ { non2xx = $NF }
        /Socket errors:/ { gsub(/,/, ""); err = $4 + $6 + $8 + $10 }
        END {
            if (rps == "" || p50 == "" || p99 == "") exit 1
            printf "%.2f %.3f %.3f %d %d %d\n", rps, p50, p99, reqs, non2xx + 0, err + 0
        }' "$1"
}

# median of the numbers on stdin
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit } if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# ---------------------------------------------------------------- main
main() {
    ensure_tools
    ensure_tollgate
    local nproc_; nproc_="$(nproc --all)"
    (( PROXY_CPU < nproc_ && LOAD_CPU < nproc_ )) || die "PROXY_CPU=$PROXY_CPU / LOAD_CPU=$LOAD_CPU: this machine has $nproc_ CPUs"

    TMP="$(mktemp -d "${TMPDIR:-/tmp}/tollgate-load.XXXXXX")"
    local ports; read -r -a ports <<< "$(free_ports 17)"
    PORT=([upstream]=${ports[0]} [nginx]=${ports[1]}
          [tg-proxy]=${ports[2]} [tg-proxy-admin]=${ports[3]}
          [tg-admit]=${ports[4]} [tg-admit-admin]=${ports[5]}
          [tg-reject]=${ports[6]} [tg-reject-admin]=${ports[7]})
    PORT[direct]=${PORT[upstream]}
    if (( REDIS )); then
        PORT+=([redis]=${ports[8]}
               [tg-global-admit]=${ports[9]} [tg-global-admit-admin]=${ports[10]}
               [tg-global-hot]=${ports[11]} [tg-global-hot-admin]=${ports[12]}
               [tg-global-cold]=${ports[13]} [tg-global-cold-admin]=${ports[14]}
               [tg-global-reserved]=${ports[15]} [tg-global-reserved-admin]=${ports[16]})
    fi

    # Is the machine quiet? (Other work on these cores skews everything.)
    local q0 q1 quiet
    q0="$(core_sample)"; sleep 1; q1="$(core_sample)"
    quiet="$(awk -v c0="$q0" -v c1="$q1" -v p="$PROXY_CPU" -v l="$LOAD_CPU" 'BEGIN { split(c0, a, " "); split(c1, b, " ")
        d0 = b[2] - a[2]; d1 = b[4] - a[4]
        printf "core %d %.0f%% busy, core %d %.0f%% busy", p, d0 ? (b[1] - a[1]) / d0 * 100 : 0, l, d1 ? (b[3] - a[3]) / d1 * 100 : 0 }')"

    log "starting upstream, nginx proxy, tollgate x3$( (( REDIS )) && echo ", redis-server, tollgate global x4") (temp dir $TMP)"
    start_upstream
    start_nginx_proxy
    start_tollgate proxy
    start_tollgate admit
    start_tollgate reject
    if (( REDIS )); then
        start_redis "${PORT[redis]}"
        start_tollgate global-admit
        start_tollgate global-reserved
        start_tollgate global-hot
        start_tollgate global-cold
    fi
    # Sanity before measuring: proxy/admit forward (200), reject admits its one
    # request and then answers 429.
    local s
    for t in tg-proxy tg-admit; do
        s="$(http_status "$(target_url $t)")"; [[ "$s" == 200 ]] || die "${LABEL[$t]} answered $s, not 200"
    done
    http_status "$(target_url tg-reject)" > /dev/null
    s="$(http_status "$(target_url tg-reject)")"; [[ "$s" == 429 ]] || die "tollgate reject answered $s, not 429"
    # Global: admit forwards (200; a 503 would be Redis failing, on_error
    # deny), hot admits or rejects; then the ceiling's script and arguments
    # are checked against what tollgate sent.
    CEILING_CHECK=""
    if (( REDIS )); then
        s="$(http_status "$(target_url tg-global-admit)")"; [[ "$s" == 200 ]] || die "tollgate global admit answered $s, not 200; log: $(tail -5 "$TMP/tg-global-admit.log")"
        s="$(http_status "$(target_url tg-global-reserved)")"; [[ "$s" == 200 ]] || die "tollgate global reserved answered $s, not 200; log: $(tail -5 "$TMP/tg-global-reserved.log")"
        s="$(http_status "$(target_url tg-global-cold)")"; [[ "$s" == 200 ]] || die "tollgate global cold answered $s, not 200; log: $(tail -5 "$TMP/tg-global-cold.log")"
        s="$(http_status "$(target_url tg-global-hot)")"; [[ "$s" == 200 || "$s" == 429 ]] || die "tollgate global hot answered $s, not 200 or 429; log: $(tail -5 "$TMP/tg-global-hot.log")"
        prepare_ceiling
    fi
    local tg_threads; tg_threads="$(awk '/^Threads:/ { print $2 }' "/proc/${TG_PID[proxy]}/status")"

    local est=$(( ${#TARGETS[@]} * (ROUNDS * (DURATION + 2) + (WARMUP > 0 ? WARMUP + 1 : 0)) ))
    local most=$(( ${#TARGETS[@]} * (ROUNDS * (RETRIES + 1) * (DURATION + WAIT_QUIET + 3) + (WARMUP > 0 ? WARMUP + WAIT_QUIET + 2 : 0)) ))
    log "${#TARGETS[@]} targets x $ROUNDS rounds x ${DURATION}s: about ${est}s on a quiet machine, ${most}s at most"

    # Warm-up; for redis-benchmark it also measures the rate that sizes its
    # runs (-n), so it runs even with WARMUP=0.
    for t in "${TARGETS[@]}"; do
        if [[ "$t" == rb-* ]]; then
            run_target "$t" "$(( WARMUP > 0 ? WARMUP : 1 ))" "$TMP/warmup-$t.txt" > /dev/null
            RB_RATE[$t]="$(parse_rb "$TMP/warmup-$t.txt" | awk '{ printf "%d", $1 }')" \
                || die "cannot parse redis-benchmark output: $(tail -3 "$TMP/warmup-$t.txt")"
        elif (( WARMUP > 0 )); then
            run_target "$t" "$WARMUP" "$TMP/warmup-$t.txt" > /dev/null
        else
            continue
        fi
        sleep 0.5
    done

    local results="$TMP/results.tsv" r t cpu parsed
    : > "$results"
    local a best best_other other f
    local order
    for ((r = 1; r <= ROUNDS; r++)); do
        # tollgate proxy and admit, the pair whose 5 % goal is the finest,
        # swap places every other round, so neither always runs first.
        order=("${TARGETS[@]}")
        if (( r % 2 == 0 )); then
            for i in "${!order[@]}"; do
                case "${order[$i]}" in tg-proxy) order[$i]=tg-admit ;; tg-admit) order[$i]=tg-proxy ;; esac
            done
        fi
        for t in "${order[@]}"; do
            # A run the rest of the machine disturbed (other% > MAX_OTHER) is
            # made again, RETRIES times at most; the least disturbed one counts.
            best=""; best_other=""
            for ((a = 0; a <= RETRIES; a++)); do
                f="$TMP/round$r-$t.try$a.txt"
                cpu="$(run_target "$t" "$DURATION" "$f")"
                parsed="$(parse_target "$t" "$f")" || die "cannot parse the output for ${LABEL[$t]}: $(cat "$f")"
                other="$(awk '{ print $4 }' <<< "$cpu")"
                if [[ -z "$best" ]] || (( other < best_other )); then best="$parsed $cpu"; best_other="$other"; fi
                (( other <= MAX_OTHER )) && break
                (( a < RETRIES )) && log "round $r/$ROUNDS ${LABEL[$t]}: other processes took ${other}% CPU, measuring again"
                sleep 1
            done
            printf '%s\t%s\t%s\n' "$r" "$t" "$best" | tr ' ' '\t' >> "$results"
            log "round $r/$ROUNDS ${LABEL[$t]}: $(awk -v redis="$REDIS" '{ printf "%.0f req/s, p50 %.3f ms, p99 %.3f ms, server %d%% CPU, other %d%%", $1, $2, $3, $7, $10
                if (redis) printf ", redis-server %d%% CPU, %d EVALSHA/EVAL/SCRIPT calls", $11, $12 }' <<< "$best")"
            sleep 1
        done
    done

    # Requests tollgate reject answered with 429, from its own metrics.
    local tg429
    tg429="$(curl -s -m 5 "http://127.0.0.1:${PORT[tg-reject-admin]}/metrics" \
        | awk '/^tollgate_requests_total\{/ && /status="429"/ { n += $NF } END { printf "%d\n", n + 0 }')"

    # ------------------------------------------------------------ report
    # results.tsv: round target rps p50 p99 requests non2xx sockerr srv% core0% core1% other%
    #   redis% rt other_cmds failed tier_redis tier_in_process tier_fallback redis_errors 429s 503s
    # (columns 13-22: see run_target; the counts are deltas over the run)
    col() { awk -F'\t' -v t="$1" -v c="$2" '$2 == t { print $c }' "$results" | median; }
    sum() { awk -F'\t' -v t="$1" -v c="$2" '$2 == t { n += $c } END { printf "%d\n", n }' "$results"; }
    declare -A RPS P50 P99 REQS NON2XX ERRS SRV K0 K1 OTHER ALL RDS RT OCMD FAILCMD TIER_R TIER_IP TIER_FB RERR S429 S503
    for t in "${TARGETS[@]}"; do
        RPS[$t]="$(col "$t" 3)"; P50[$t]="$(col "$t" 4)"; P99[$t]="$(col "$t" 5)"
        SRV[$t]="$(col "$t" 9)"; K0[$t]="$(col "$t" 10)"; K1[$t]="$(col "$t" 11)"; OTHER[$t]="$(col "$t" 12)"
        RDS[$t]="$(col "$t" 13)"
        REQS[$t]="$(sum "$t" 6)"; NON2XX[$t]="$(sum "$t" 7)"; ERRS[$t]="$(sum "$t" 8)"
        RT[$t]="$(sum "$t" 14)"; OCMD[$t]="$(sum "$t" 15)"; FAILCMD[$t]="$(sum "$t" 16)"
        TIER_R[$t]="$(sum "$t" 17)"; TIER_IP[$t]="$(sum "$t" 18)"; TIER_FB[$t]="$(sum "$t" 19)"
        RERR[$t]="$(sum "$t" 20)"; S429[$t]="$(sum "$t" 21)"; S503[$t]="$(sum "$t" 22)"
        ALL[$t]="$(awk -F'\t' -v t="$t" '$2 == t { printf "%s%.0f", sep, $3; sep = " " }' "$results")"
    done
    # tollgate_redis_errors_total by kind at the end (warm-up included).
    local errs_admit="" errs_hot="" errs_cold="" errs_reserved=""
    if (( REDIS )); then errs_admit="$(tg_redis_errors tg-global-admit)"; errs_hot="$(tg_redis_errors tg-global-hot)"; errs_cold="$(tg_redis_errors tg-global-cold)"; errs_reserved="$(tg_redis_errors tg-global-reserved)"; fi

    local commit dirty=""
    commit="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if [[ -n "$(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null)" ]]; then
        dirty=" (plus uncommitted changes under src/ or Cargo.*)"
    fi
    local cpu_model; cpu_model="$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo)"

    echo
    echo "tollgate load: tollgate next to nginx, same run, same machine"
    echo "command   : $INVOKED   (DURATION=$DURATION ROUNDS=$ROUNDS CONNECTIONS=$CONNECTIONS WARMUP=$WARMUP)"
    echo "commit    : $commit$dirty"
    echo "date      : $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host      : $nproc_ CPUs (${cpu_model:-unknown}), Linux $(uname -r); before start: $quiet"
    local redis_version=""
    (( REDIS )) && redis_version=", redis $(redis-server --version | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^v=/) print substr($i, 3) }')"
    echo "versions  : $("$TOLLGATE_BIN" --version), $(nginx -v 2>&1 | sed 's/^nginx version: //'), $(wrk -v 2>&1 | awk 'NR == 1 { print $1, $2 }')$redis_version"
    echo "core $PROXY_CPU    : proxy under test alone: nginx (worker_processes 1) | tollgate (TOKIO_WORKER_THREADS=1, $tg_threads threads, RUST_LOG=warn)"
    if (( REDIS )); then
        echo "core $LOAD_CPU    : taskset -c $LOAD_CPU wrk -t1 -c$CONNECTIONS -d${DURATION}s --latency URL, the upstream (nginx, 1 worker, return 200 \"ok\\n\")"
        echo "            and redis-server (--save '' --appendonly no; tollgate global: pool_size 2, timeout 50ms, on_error deny)"
        echo "ceiling   : taskset -c $LOAD_CPU redis-benchmark -c $RB_CLIENTS -n N [-P 16] EVALSHA <decide.lua sha> 1 $RB_KEY ${RB_ARGV[*]}"
        echo "            (N = ${DURATION}s at the warm-up's rate; redis-benchmark shares core $LOAD_CPU with redis-server, so the ceiling is low by the client's CPU)"
    else
        echo "core $LOAD_CPU    : taskset -c $LOAD_CPU wrk -t1 -c$CONNECTIONS -d${DURATION}s --latency URL, and the upstream (nginx, 1 worker, return 200 \"ok\\n\")"
    fi
    echo "figures   : median of $ROUNDS interleaved round(s); srv% = CPU of the target's server (% of one core$( (( REDIS )) && echo "; redis-bench rows: redis-server")),"
    echo "            core% = that core busy, other% = CPU the two cores gave to anything but server, upstream, $( (( REDIS )) && echo "redis-server, ")load tool (should be ~0)$( (( REDIS )) && echo ";")"
    (( REDIS )) && echo "            rds% = redis-server's CPU"
    echo
    local rh="" rv=""
    if (( REDIS )); then rh=" %5s"; rv=" %5.0f"; fi
    printf "%-24s %9s %8s %8s %5s$rh %6s %6s %6s  %s\n" target "req/s" "p50 ms" "p99 ms" "srv%" $( (( REDIS )) && echo "rds%") "core$PROXY_CPU%" "core$LOAD_CPU%" "other%" "req/s per round"
    for t in "${TARGETS[@]}"; do
        printf "%-24s %9.0f %8.3f %8.3f %5.0f$rv %6.0f %6.0f %6.0f  %s\n" "${LABEL[$t]}" "${RPS[$t]}" "${P50[$t]}" "${P99[$t]}" \
            "${SRV[$t]}" $( (( REDIS )) && echo "${RDS[$t]}") "${K0[$t]}" "${K1[$t]}" "${OTHER[$t]}" "${ALL[$t]}"
    done
    echo

    # CPU per request on each core (busy share / req/s, from the medians). Both cores run
    # near 100 % in every proxied target, so a ratio of requests/s between two targets is about
    # the ratio of their CPU per request on whichever core is fuller: each ratio goal's line is
    # followed by both cores' (at equal load on that core). Core 0 is the server's alone;
    # core 1 is the load side's (wrk, the upstream), which the server changes only through
    # the bytes it sends and asks for. A goal missed by requests/s while both cores' figures
    # pass it was missed by the machine's load moving between runs, not by a cost.
    us() { awk -v pct="$1" -v rps="$2" 'BEGIN { printf "%.2f", (rps > 0 ? pct / 100 / rps * 1e6 : 0) }'; }
    declare -A US_SRV US_K0 US_K1
    printf "%-24s %9s %8s %8s   %s\n" "CPU per request (us)" "server" "core$PROXY_CPU" "core$LOAD_CPU" "(srv% / core% over req/s)"
    local us_targets=(nginx tg-proxy tg-admit tg-reject)
    (( REDIS )) && us_targets+=(tg-global-admit tg-global-reserved tg-global-cold)
    for t in "${us_targets[@]}"; do
        US_SRV[$t]="$(us "${SRV[$t]}" "${RPS[$t]}")"; US_K0[$t]="$(us "${K0[$t]}" "${RPS[$t]}")"; US_K1[$t]="$(us "${K1[$t]}" "${RPS[$t]}")"
        printf "%-24s %9s %8s %8s\n" "${LABEL[$t]}" "${US_SRV[$t]}" "${US_K0[$t]}" "${US_K1[$t]}"
    done
    echo
    allows() {  # allows NUM_TARGET DEN_TARGET: each core's ratio of CPU per request, den / num
        awk -v s0="${US_K0[$2]}" -v s1="${US_K0[$1]}" -v l0="${US_K1[$2]}" -v l1="${US_K1[$1]}" -v p="$PROXY_CPU" -v l="$LOAD_CPU" \
            -v what="  the same in CPU per request, at equal load" \
            'BEGIN { printf "%-48s core %d (server) %.3f, core %d (load side) %.3f\n", what, p, (s1 > 0 ? s0 / s1 : 0), l, (l1 > 0 ? l0 / l1 : 0) }'
    }

    local failed=0 unsound=0
    ratio() {  # ratio LABEL NUM DEN OP GOAL (OP "-": no goal, the figure is information)
        local v res
        # Five decimals below 0.01 (a reserved hot key's calls per request), else three.
        v="$(awk -v n="$2" -v d="$3" 'BEGIN { if (d == 0) print "nan"; else if (n / d < 0.01) printf "%.5f", n / d; else printf "%.3f", n / d }')"
        if [[ "$4" == - ]]; then
            printf '%-48s %7s   (no goal)\n' "$1" "$v"
            return 0
        fi
        if awk -v v="$v" -v g="$5" -v op="$4" 'BEGIN { if (v == "nan") exit 1; exit !(op == ">=" ? v >= g : op == "<" ? v < g : v <= g) }'; then
            res=PASS
        else
            res=FAIL; failed=1
        fi
        printf '%-48s %7s   goal %-2s %-5s %s\n' "$1" "$v" "$4" "$5" "$res"
    }
    ratio "tollgate proxy / nginx proxy  (req/s)" "${RPS[tg-proxy]}" "${RPS[nginx]}" ">=" 1.0
    ratio "tollgate proxy / nginx proxy  (p99)" "${P99[tg-proxy]}" "${P99[nginx]}" "<=" 1.0
    ratio "tollgate admit / tollgate proxy (req/s)" "${RPS[tg-admit]}" "${RPS[tg-proxy]}" ">=" 0.95
    # The same goal paired by round: each round's admit over the same round's
    # proxy (run back to back), so a drift between rounds cancels out instead
    # of moving one median and not the other. Information beside the goal line.
    local paired
    paired="$(awk -F'\t' '$2 == "tg-proxy" { p[$1] = $3 } $2 == "tg-admit" { a[$1] = $3 }
        END { for (r = 1; r in p; r++) if (r in a && p[r] > 0) printf "%.3f\n", a[r] / p[r] }' "$results")"
    printf '%-48s %7.3f   (rounds 1..%d: %s)\n' "  the same, paired by round: median" "$(median <<< "$paired")" "$ROUNDS" "$(tr '\n' ' ' <<< "$paired" | sed 's/ $//')"
    allows tg-admit tg-proxy
    ratio "tollgate reject / tollgate admit (req/s)" "${RPS[tg-reject]}" "${RPS[tg-admit]}" ">=" 2.0
    allows tg-reject tg-admit
    if (( REDIS )); then
        # Issue 20's hot-key goal is met by reservations (off by default: they give up
        # burst); per-request decisions on a hot key are the information beside it.
        ratio "tollgate global reserved / tollgate admit (req/s)" "${RPS[tg-global-reserved]}" "${RPS[tg-admit]}" ">=" 0.9
        allows tg-global-reserved tg-admit
        ratio "global reserved (hot key): Redis calls per request" "${RT[tg-global-reserved]}" "$(( REQS[tg-global-reserved] + ROUNDS * CONNECTIONS ))" "<=" 0.1
        ratio "tollgate global admit / tollgate admit (req/s)" "${RPS[tg-global-admit]}" "${RPS[tg-admit]}" - -
        allows tg-global-admit tg-admit
        ratio "tollgate global cold / tollgate admit (req/s)" "${RPS[tg-global-cold]}" "${RPS[tg-admit]}" ">=" 0.8
        allows tg-global-cold tg-admit
        # Requests sent: wrk's completed ones plus the one each connection
        # still has in flight when wrk stops (its call may already be out).
        ratio "global admit (hot key): Redis calls per request" "${RT[tg-global-admit]}" "$(( REQS[tg-global-admit] + ROUNDS * CONNECTIONS ))" "<=" 0.1
        ratio "global cold: Redis calls per request" "${RT[tg-global-cold]}" "$(( REQS[tg-global-cold] + ROUNDS * CONNECTIONS ))" - -
        ratio "global hot: Redis commands per rejected request" "${RT[tg-global-hot]}" "${NON2XX[tg-global-hot]}" "<" 0.05
        ratio "global admit decisions/s / redis-bench EVALSHA/s" "${RPS[tg-global-admit]}" "${RPS[rb-evalsha]}" - -
        ratio "global admit decisions/s / redis-bench -P16" "${RPS[tg-global-admit]}" "${RPS[rb-evalsha-p16]}" - -
    fi
    echo
    if (( REDIS )); then
        # Where the Redis figures come from, summed over the counted runs.
        echo "redis     : global admit: ${RT[tg-global-admit]} EVALSHA/EVAL/SCRIPT calls (INFO commandstats) for ${REQS[tg-global-admit]} requests wrk completed"
        echo "            ($(awk -v c="${RT[tg-global-admit]}" -v n="${REQS[tg-global-admit]}" 'BEGIN { printf "%.5f", n ? c / n : 0 }') per completed request) + $CONNECTIONS in flight at each of $ROUNDS stop(s) = $(( REQS[tg-global-admit] + ROUNDS * CONNECTIONS )) sent;"
        echo "            tollgate's tier=\"redis\" counter: ${TIER_R[tg-global-admit]} decisions; inside the script Redis also ran $(awk -v o="${OCMD[tg-global-admit]}" -v n="${RT[tg-global-admit]}" 'BEGIN { printf "%.2f", n ? o / n : 0 }') commands per call (GET/TIME/SET, not round trips)"
        echo "redis     : global reserved: ${RT[tg-global-reserved]} calls for ${REQS[tg-global-reserved]} requests wrk completed ($(awk -v c="${RT[tg-global-reserved]}" -v n="${REQS[tg-global-reserved]}" 'BEGIN { printf "%.6f", n ? c / n : 0 }') per request; reserve_ahead: 100ms on the hot key)"
        echo "redis     : global hot: ${RT[tg-global-hot]} EVALSHA/EVAL/SCRIPT calls for ${NON2XX[tg-global-hot]} non-2xx of ${REQS[tg-global-hot]} requests ($(( REQS[tg-global-hot] - NON2XX[tg-global-hot] )) admitted);"
        echo "            tollgate's tiers: in_process ${TIER_IP[tg-global-hot]}, redis ${TIER_R[tg-global-hot]}, fallback ${TIER_FB[tg-global-hot]};"
        echo "            $(awk -v c="${RT[tg-global-hot]}" -v r="$HOT_RATE" -v s="$(( ROUNDS * DURATION ))" 'BEGIN { printf "%.1f", c / (r * s) }') calls per emission interval (1/${HOT_RATE} s; wrk keeps $CONNECTIONS requests in flight)"
        echo "redis     : global cold: ${RT[tg-global-cold]} calls for ${REQS[tg-global-cold]} requests wrk completed ($(awk -v c="${RT[tg-global-cold]}" -v n="${REQS[tg-global-cold]}" 'BEGIN { printf "%.3f", n ? c / n : 0 }') per request, each a new key)"
        # Redis cores per million admitted requests/s: redis-server's CPU share over the rate.
        echo "redis     : redis-server CPU per admitted request: global admit (hot key) $(us "${RDS[tg-global-admit]}" "${RPS[tg-global-admit]}") us, global reserved $(us "${RDS[tg-global-reserved]}" "${RPS[tg-global-reserved]}") us, global cold $(us "${RDS[tg-global-cold]}" "${RPS[tg-global-cold]}") us"
        echo "            = Redis cores per million admitted requests/s: hot $(awk -v p="${RDS[tg-global-admit]}" -v r="${RPS[tg-global-admit]}" 'BEGIN { printf "%.2f", (r > 0 ? p / 100 / r * 1e6 : 0) }'), hot reserved $(awk -v p="${RDS[tg-global-reserved]}" -v r="${RPS[tg-global-reserved]}" 'BEGIN { printf "%.3f", (r > 0 ? p / 100 / r * 1e6 : 0) }') (whole-percent CPU readings: 0 means under 1 %), cold $(awk -v p="${RDS[tg-global-cold]}" -v r="${RPS[tg-global-cold]}" 'BEGIN { printf "%.2f", (r > 0 ? p / 100 / r * 1e6 : 0) }') (wall-clock CPU, socket work included)"
        echo "redis     : tollgate_redis_errors_total at the end (warm-up included): global admit: $errs_admit; global reserved: $errs_reserved; global cold: $errs_cold; global hot: $errs_hot"
        echo "redis     : redis-server CPU (rds%): global admit ${RDS[tg-global-admit]}%, global reserved ${RDS[tg-global-reserved]}%, redis-bench ${RDS[rb-evalsha]}% / -P16 ${RDS[rb-evalsha-p16]}%; tollgate (srv%) in global admit ${SRV[tg-global-admit]}%, in admit ${SRV[tg-admit]}%"
        echo
    fi

    check() {  # check OK? TEXT
        if [[ "$1" == 1 ]]; then printf 'check ok   : %s\n' "$2"; else printf 'check FAIL : %s\n' "$2"; unsound=1; fi
    }
    local ok_targets=(direct nginx tg-proxy tg-admit)
    (( REDIS )) && ok_targets+=(tg-global-admit tg-global-reserved tg-global-cold)
    for t in "${ok_targets[@]}"; do
        check "$([[ ${NON2XX[$t]} == 0 ]] && echo 1)" "${LABEL[$t]}: all ${REQS[$t]} responses 2xx (non-2xx: ${NON2XX[$t]})"
    done
    check "$(awk -v n="${NON2XX[tg-reject]}" -v r="${REQS[tg-reject]}" 'BEGIN { if (r > 0 && n >= 0.999 * r) print 1 }')" \
        "tollgate reject: ${NON2XX[tg-reject]} of ${REQS[tg-reject]} responses non-2xx (wrk); its /metrics counts $tg429 answered 429 (warm-up included)"
    check "$(awk -v m="$tg429" -v n="${NON2XX[tg-reject]}" 'BEGIN { if (m >= n) print 1 }')" \
        "tollgate reject: the non-2xx answers are 429s (metrics 429 count $tg429 >= wrk non-2xx ${NON2XX[tg-reject]})"
    if (( REDIS )); then
        local hot_ok=$(( REQS[tg-global-hot] - NON2XX[tg-global-hot] ))
        local hot_max=$(( ROUNDS * (HOT_BURST + HOT_RATE * (DURATION + 1)) ))
        check "$(awk -v a="$hot_ok" -v m="$hot_max" 'BEGIN { if (a > 0 && a <= m) print 1 }')" \
            "tollgate global hot: the global limit limits: $hot_ok admitted over $ROUNDS run(s), 0 < admitted <= $hot_max (burst $HOT_BURST + ${HOT_RATE}/s x (${DURATION}s + 1 s) per run)"
        check "$(awk -v m="${S429[tg-global-hot]}" -v n="${NON2XX[tg-global-hot]}" 'BEGIN { if (m >= n && n > 0) print 1 }')" \
            "tollgate global hot: the non-2xx answers are 429s (metrics 429 count ${S429[tg-global-hot]} >= wrk non-2xx ${NON2XX[tg-global-hot]})"
        for t in tg-global-admit tg-global-reserved tg-global-cold tg-global-hot; do
            check "$([[ ${RERR[$t]} == 0 && ${S503[$t]} == 0 && ${TIER_FB[$t]} == 0 ]] && echo 1)" \
                "${LABEL[$t]}: Redis answered every decision: redis errors ${RERR[$t]}, 503s ${S503[$t]}, fallback decisions ${TIER_FB[$t]} during the runs"
        done
        # Every request of global admit and cold was decided by Redis (tier
        # redis ~ wrk's requests, up to those in flight when wrk stops, one per
        # connection per run), in no more calls than decisions.
        for t in tg-global-admit tg-global-cold; do
            check "$(awk -v a="${RT[$t]}" -v b="${TIER_R[$t]}" -v n="${REQS[$t]}" -v slack=$(( ROUNDS * CONNECTIONS )) '
                    BEGIN { if (n > 0 && a > 0 && a <= b + slack && b >= n && b - n <= slack) print 1 }')" \
                "${LABEL[$t]}: Redis's call count ${RT[$t]} <= tollgate's tier=redis decisions ${TIER_R[$t]} ~ wrk requests ${REQS[$t]} (+- $(( ROUNDS * CONNECTIONS )) in flight)"
        done
        local failcmd=0; for t in "${TARGETS[@]}"; do failcmd=$((failcmd + FAILCMD[$t])); done
        check "$([[ $failcmd == 0 ]] && echo 1)" "Redis: no failed or rejected command during the runs (NOSCRIPT, script errors: $failcmd)"
        check 1 "ceiling: $CEILING_CHECK"
    fi
    local errs=0; for t in "${TARGETS[@]}"; do errs=$((errs + ERRS[$t])); done
    check "$([[ $errs == 0 ]] && echo 1)" "no wrk socket errors (connect/read/write/timeout: $errs)"
    # A proxy target whose server had CPU to spare while wrk's core was full is
    # measuring wrk, not the server.
    local warn_targets=(nginx tg-proxy tg-admit tg-reject) core1
    (( REDIS )) && warn_targets+=(tg-global-admit tg-global-reserved tg-global-cold tg-global-hot)
    for t in "${warn_targets[@]}"; do
        case "$t" in
            tg-reject) core1=" alone" ;;
            tg-global-*) core1=" + upstream + redis-server" ;;
            *) core1=" + upstream" ;;
        esac
        if awk -v s="${SRV[$t]}" -v k="${K1[$t]}" 'BEGIN { exit !(k >= 90 && s < 90) }'; then
            printf 'check WARN : %s: server at %s%% CPU while core %s (wrk%s) was %s%% busy: the load generator may cap this figure\n' \
                "${LABEL[$t]}" "${SRV[$t]}" "$LOAD_CPU" "$core1" "${K1[$t]}"
        fi
    done
    local worst; worst="$(awk -F'\t' '$12 > m { m = $12 } END { print m + 0 }' "$results")"
    if (( worst <= MAX_OTHER )); then
        printf 'check ok   : quiet machine: other processes took at most %s%% CPU during any run\n' "$worst"
    else
        printf 'check WARN : other processes took up to %s%% CPU during a run (see other%%): the figures are noisy\n' "$worst"
    fi
    echo

    if (( unsound )); then log "a sanity check failed: the figures above are not a valid comparison"; exit 2; fi
    (( failed )) && exit 1
    exit 0
}

main
