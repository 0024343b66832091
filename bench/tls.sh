#!/usr/bin/env bash
# bench/tls.sh — tollgate next to nginx over TLS and HTTP/2, in one run, on one machine.
#
#   bench/tls.sh             # DURATION=10 ROUNDS=3
#   bench/tls.sh --quick     # smoke run: DURATION=3 ROUNDS=1
#   KINDS="https h2" ROUNDS=5 bench/tls.sh
#
# The sibling of bench/load.sh (plain HTTP/1.1, limits, Redis) for the traffic public
# APIs see: TLS and HTTP/2. Layout (2 cores), as load.sh's:
#   core PROXY_CPU: the proxy under test, alone — nginx (1 worker) or tollgate
#           (TOKIO_WORKER_THREADS=1, RUST_LOG=warn);
#   core LOAD_CPU:  the load tool (wrk -t1, h2load -t1, openssl s_time) and the
#           upstream (an nginx worker answering `return 200 "ok\n"`).
# Both proxies get the certificate this script makes (ECDSA P-256 by default, the cheapest
# safe signature widely trusted; CERT=rsa for RSA-2048), TLS 1.2 + 1.3 (clients
# negotiate 1.3; checked), X25519 first,
# the server's cipher order with AES-128-GCM first, session tickets and a session
# cache (bench/load/tls.nginx.conf, bench/load/tollgate-tls.yaml).
#
# Kinds of traffic (KINDS), each run against nginx and tollgate back to back:
#   http   plain HTTP/1.1, keep-alive: wrk -c CONNECTIONS (load.sh's comparison)
#   https  HTTP/1.1 over TLS, keep-alive: wrk -c CONNECTIONS https://
#   new    a new TLS connection per request: wrk -c CONNECTIONS -H 'Connection: close'
#          (wrk resumes the session of its previous connection: TLS 1.3 PSK with an
#          X25519 exchange, no certificate)
#   h2     HTTP/2 over TLS: h2load -c H2_CONNECTIONS -m H2_STREAMS
#   h2c    HTTP/2 without TLS (prior knowledge): h2load, the same
#   full   full TLS 1.3 handshakes, nothing else: openssl s_time -new (one at a
#          time, so the server is not saturated: its CPU per handshake is the figure)
# Rounds are interleaved (every kind once per round; who goes first alternates),
# each figure is the median over rounds, and each ratio is tollgate / nginx.
#
# Environment knobs:
#   DURATION=10 ROUNDS=3 WARMUP=2   seconds per run, rounds, warm-up seconds per target
#   CONNECTIONS=64                  wrk connections
#   H2_CONNECTIONS=16 H2_STREAMS=16 h2load connections and streams per connection
#   KINDS="http https new h2 h2c full"
#   CERT=ec                         the certificate's key: ec (ECDSA P-256) or rsa (RSA-2048)
#   PROXY_CPU=0 LOAD_CPU=1          cores
#   TOLLGATE_BIN=...                this binary instead of target/release/tollgate
#   KEEP=1                          keep the temp dir (configs, logs, raw outputs)
#   WAIT_QUIET=20 QUIET_BUSY=15     before each run, wait up to WAIT_QUIET s for
#                                   both cores to be under QUIET_BUSY % busy
#
# Exit status: 0 every goal PASS; 1 a goal FAILed (the measurement is sound);
# 2 the measurement is not sound (a check failed, a server did not start, a tool
# is missing).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
TEMPLATES="$HERE/load"
INVOKED="bench/tls.sh${*:+ $*}"

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -h|--help) sed -n '2,/^set -E/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "tls.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
if (( QUICK )); then DURATION="${DURATION:-3}"; ROUNDS="${ROUNDS:-1}"; WARMUP="${WARMUP:-1}"; fi
DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-2}"
CONNECTIONS="${CONNECTIONS:-64}"
H2_CONNECTIONS="${H2_CONNECTIONS:-16}"
H2_STREAMS="${H2_STREAMS:-16}"
KINDS="${KINDS:-http https new h2 h2c full}"
CERT="${CERT:-ec}"
[[ "$CERT" == ec || "$CERT" == rsa ]] || { echo "tls.sh: CERT must be ec or rsa, got '$CERT'" >&2; exit 2; }
PROXY_CPU="${PROXY_CPU:-0}"
LOAD_CPU="${LOAD_CPU:-1}"
KEEP="${KEEP:-0}"
WAIT_QUIET="${WAIT_QUIET:-20}"
QUIET_BUSY="${QUIET_BUSY:-15}"
for v in DURATION ROUNDS WARMUP CONNECTIONS H2_CONNECTIONS H2_STREAMS PROXY_CPU LOAD_CPU WAIT_QUIET QUIET_BUSY; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "tls.sh: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
(( DURATION > 0 && ROUNDS > 0 )) || { echo "tls.sh: DURATION and ROUNDS must be > 0" >&2; exit 2; }
read -r -a KIND_LIST <<< "$KINDS"
for k in "${KIND_LIST[@]}"; do
    [[ " http https new h2 h2c full " == *" $k "* ]] || { echo "tls.sh: unknown kind '$k' in KINDS" >&2; exit 2; }
done

declare -A KIND_LABEL=(
    [http]="HTTP/1.1 keep-alive"
    [https]="HTTPS/1.1 keep-alive"
    [new]="new TLS connections"
    [h2]="HTTP/2 over TLS"
    [h2c]="h2c (no TLS)"
    [full]="full TLS handshakes"
)
# Goals of issue 21 (tollgate / nginx, requests per second); "-" is information only.
declare -A GOAL=([http]=1.25 [https]=1.1 [new]=1.0 [h2]=1.0 [h2c]=- [full]=-)

HARNESS=tls.sh
# shellcheck source=bench/harness.sh
source "$HERE/harness.sh"

# ---------------------------------------------------------------- tools
ensure_tools() {
    local missing=() pair cmd pkg
    for pair in wrk:wrk nginx:nginx h2load:nghttp2-client openssl:openssl taskset:util-linux curl:curl python3:python3; do
        cmd="${pair%%:*}"; pkg="${pair#*:}"
        command -v "$cmd" >/dev/null || missing+=("$pkg")
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

ensure_tollgate() {
    if [[ -n "${TOLLGATE_BIN:-}" ]]; then
        [[ -x "$TOLLGATE_BIN" ]] || die "TOLLGATE_BIN=$TOLLGATE_BIN is not executable"
        return 0
    fi
    TOLLGATE_BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/tollgate"
    local stale=""
    if [[ ! -x "$TOLLGATE_BIN" ]]; then
        stale="no release binary"
    else
        stale="$(find "$REPO/src" "$REPO/Cargo.toml" "$REPO/Cargo.lock" -newer "$TOLLGATE_BIN" -print -quit 2>/dev/null || true)"
        [[ -n "$stale" ]] && stale="$stale is newer than the binary"
    fi
    if [[ -n "$stale" ]]; then
        log "building: cargo build --release ($stale)"
        (cd "$REPO" && timeout --foreground 1800 cargo build --release --bin tollgate) >&2 \
            || die "cargo build --release failed"
    fi
}

# ---------------------------------------------------------------- helpers
free_ports() {
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

render() {  # render TEMPLATE OUT NAME=VALUE...
    local src="$TEMPLATES/$1" out="$2"; shift 2
    local script=() kv
    for kv in "$@"; do script+=(-e "s|@${kv%%=*}@|${kv#*=}|g"); done
    sed "${script[@]}" "$src" > "$out"
    if grep -q '@[A-Z_]*@' "$out"; then die "unfilled placeholder in $out: $(grep -o '@[A-Z_]*@' "$out" | head -1)"; fi
}

spawn() {  # spawn NAME CPU CMD...: pinned, in the background, output to $TMP/NAME.log
    local name="$1" cpu="$2"; shift 2
    taskset -c "$cpu" "$@" > "$TMP/$name.log" 2>&1 < /dev/null &
    SPAWNED=$!
    PIDS+=("$SPAWNED")
}

wait_http() {  # wait_http NAME PID URL CURL_ARGS...: until URL answers 200 (10 s at most)
    local name="$1" pid="$2" url="$3"; shift 3
    local code="" deadline=$((SECONDS + 10))
    while (( SECONDS < deadline )); do
        kill -0 "$pid" 2>/dev/null || die "$name exited during startup: $(tail -5 "$TMP/$name.log")"
        code="$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$@" "$url" 2>/dev/null || true)"
        [[ "$code" == 200 ]] && return 0
        sleep 0.1
    done
    die "$name did not answer $url with 200 within 10s (last: $code): $(tail -5 "$TMP/$name.log")"
}

nginx_user_line() { if (( EUID == 0 )); then echo "user root;"; else echo ""; fi; }

start_nginx() {  # start_nginx NAME CPU TEMPLATE NAME=VALUE...
    local name="$1" cpu="$2" tmpl="$3"; shift 3
    local dir="$TMP/$name"
    mkdir -p "$dir/tmp" "$dir/logs"
    render "$tmpl" "$dir/nginx.conf" DIR="$dir" USER_LINE="$(nginx_user_line)" "$@"
    nginx -p "$dir/" -c "$dir/nginx.conf" -t > "$TMP/$name.log" 2>&1 || die "nginx -t for $name: $(cat "$TMP/$name.log")"
    spawn "$name" "$cpu" nginx -p "$dir/" -c "$dir/nginx.conf" -g 'daemon off;'
}

start_tollgate() {  # start_tollgate NAME TEMPLATE PORT ADMIN_PORT
    local name="$1" cfg="$TMP/$1.yaml"
    render "$2" "$cfg" PORT="$3" ADMIN_PORT="$4" UPSTREAM_PORT="${PORT[upstream]}" DIR="$TMP"
    "$TOLLGATE_BIN" check --config "$cfg" > "$TMP/$name.check" 2>&1 || die "tollgate check $cfg: $(cat "$TMP/$name.check")"
    spawn "$name" "$PROXY_CPU" env TOKIO_WORKER_THREADS=1 RUST_LOG=warn "$TOLLGATE_BIN" run --config "$cfg"
    PID[$name]=$SPAWNED
    wait_http "$name" "$SPAWNED" "http://127.0.0.1:$4/healthz"
}

CLK_TCK="$(getconf CLK_TCK)"
cpu_ticks() {  # utime+stime of these processes (all threads), in clock ticks
    local t=0 pid f
    for pid in "$@"; do
        [[ -r "/proc/$pid/stat" ]] || continue
        f="$(sed 's/.*) //' "/proc/$pid/stat")"
        set -- $f
        t=$((t + ${12} + ${13}))
    done
    echo "$t"
}
core_sample() {  # "busy0 total0 busy1 total1 work" of PROXY_CPU and LOAD_CPU (see load.sh)
    awk -v a="cpu$PROXY_CPU" -v b="cpu$LOAD_CPU" '
        $1 == a || $1 == b { tot = 0; for (i = 2; i <= 9; i++) tot += $i; r[$1] = (tot - $5 - $6) " " tot; w += $2 + $3 + $4 + $7 + $8 }
        END { print r[a], r[b], w }' /proc/stat
}
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
        (( SECONDS >= deadline )) && { log "warning: a core is still ${busy}% busy after ${WAIT_QUIET}s; measuring anyway"; return 0; }
    done
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit } if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# ---------------------------------------------------------------- targets
# A target is SERVER-KIND (nginx-https, tg-h2, ...).
declare -A PORT PID
server_pids() {  # the server's processes (nginx: master and worker)
    local pid="${PID[$1]}"
    echo "$pid" $(pgrep -P "$pid" 2>/dev/null || true)
}
target_url() {  # target_url SERVER KIND
    local s="$1" k="$2"
    case "$k" in
        http) echo "http://127.0.0.1:${PORT[$s-http]}/" ;;
        h2c) echo "http://127.0.0.1:${PORT[$s-h2c]}/" ;;
        *) echo "https://127.0.0.1:${PORT[$s-tls]}/" ;;
    esac
}
load_cmd() {  # load_cmd SERVER KIND SECONDS: the load tool's command line
    local url; url="$(target_url "$1" "$2")"
    case "$2" in
        http|https) echo wrk -t1 -c"$CONNECTIONS" -d"${3}s" --latency "$url" ;;
        new) echo wrk -t1 -c"$CONNECTIONS" -d"${3}s" --latency -H "'Connection: close'" "$url" ;;
        h2|h2c) echo h2load -t1 -c"$H2_CONNECTIONS" -m"$H2_STREAMS" -D"$3" "$url" ;;
        full) echo openssl s_time -connect "127.0.0.1:${PORT[$1-tls]}" -new -time "$3" ;;
    esac
}

# parse OUTFILE KIND: "rps p50_ms p99_ms requests non2xx errors" (h2load: mean latency as
# p50, p99 0; s_time: the handshakes made, no rate (main divides by the run's time), no
# latency)
parse() {
    case "$2" in
        http|https|new) awk '
            function ms(v) {
                if (v ~ /us$/) return substr(v, 1, length(v) - 2) / 1000
                if (v ~ /ms$/) return substr(v, 1, length(v) - 2) + 0
                if (v ~ /s$/)  return substr(v, 1, length(v) - 1) * 1000
                return v + 0
            }
            $1 == "50%" { p50 = ms($2) } $1 == "99%" { p99 = ms($2) }
            / requests in / { reqs = $1 } /^Requests\/sec:/ { rps = $2 }
            /Non-2xx or 3xx responses:/ { non2xx = $NF }
            /Socket errors:/ { gsub(/,/, ""); err = $4 + $6 + $8 + $10 }
            END { if (rps == "") exit 1; printf "%.2f %.3f %.3f %d %d %d\n", rps, p50, p99, reqs, non2xx + 0, err + 0 }' "$1" ;;
        h2|h2c) awk '
            function ms(v) {
                if (v ~ /us$/) return substr(v, 1, length(v) - 2) / 1000
                if (v ~ /ms$/) return substr(v, 1, length(v) - 2) + 0
                if (v ~ /s$/)  return substr(v, 1, length(v) - 1) * 1000
                return v + 0
            }
            /^finished in/ { rps = $4 }
            /^requests:/ { done = $8; failed = $10 + $12 + $14 }
            /^status codes:/ { non2xx = $5 + $7 + $9 }
            /^time for request:/ { mean = ms($6) }
            END { if (rps == "") exit 1; printf "%.2f %.3f 0 %d %d %d\n", rps, mean, done, non2xx, failed }' "$1" ;;
        full) awk '
            / connections in .* real seconds/ { n = $1 }
            END { if (n == "") exit 1; printf "0 0 0 %d 0 0\n", n }' "$1" ;;
    esac
}

# The process serving KIND for SERVER: tollgate's plain listener (tg) serves http and h2c,
# its TLS one (tgs) the rest.
proc_of() { if [[ $1 == tg && $2 != http && $2 != h2c ]]; then echo tgs; else echo "$1"; fi; }

# run SERVER KIND SECONDS OUTFILE: one run; prints "srv% core0% core1% other% seconds"
run() {
    local s k="$2" secs="$3" out="$4"
    s="$(proc_of "$1" "$2")"
    local p; for p in $(server_pids "$s") $(server_pids upstream); do
        kill -0 "$p" 2>/dev/null || die "$s or the upstream (pid $p) is gone: $(tail -5 "$TMP/$s.log")"
    done
    wait_quiet
    local pids aux cmd
    pids="$(server_pids "$s")"; aux="$(server_pids upstream)"
    cmd="$(load_cmd "$1" "$k" "$secs")"
    local t0 u0 c0 ns0 t1 u1 c1 ns1
    t0="$(cpu_ticks $pids)"; u0="$(cpu_ticks $aux)"; c0="$(core_sample)"; ns0="$(date +%s%N)"
    timeout --foreground $((secs + 30)) taskset -c "$LOAD_CPU" bash -c \
        'eval "${@:2}"; rc=$?; times > "$1"; exit $rc' _ "$out.times" "$cmd" > "$out" 2>&1 \
        || die "$cmd failed: $(tail -3 "$out")"
    ns1="$(date +%s%N)"; c1="$(core_sample)"; t1="$(cpu_ticks $pids)"; u1="$(cpu_ticks $aux)"
    awk -v t0="$t0" -v t1="$t1" -v u="$((u1 - u0))" -v hz="$CLK_TCK" -v ns=$((ns1 - ns0)) -v c0="$c0" -v c1="$c1" '
        function secs(v,   m) { m = index(v, "m"); return substr(v, 1, m - 1) * 60 + substr(v, m + 1, length(v) - m - 1) }
        NR == 2 { tool = secs($1) + secs($2) }
        END {
            split(c0, a, " "); split(c1, b, " "); el = ns / 1e9
            k0 = (b[2] - a[2]) ? (b[1] - a[1]) / (b[2] - a[2]) * 100 : 0
            k1 = (b[4] - a[4]) ? (b[3] - a[3]) / (b[4] - a[4]) * 100 : 0
            other = ((b[5] - a[5]) - (t1 - t0) - u) / hz - tool
            printf "%.1f %.0f %.0f %.0f %.3f\n", (t1 - t0) / hz / el * 100, k0, k1, (other > 0 ? other : 0) / el * 100, el
        }' "$out.times"
}

# ---------------------------------------------------------------- main
main() {
    ensure_tools
    ensure_tollgate
    local nproc_; nproc_="$(nproc --all)"
    (( PROXY_CPU < nproc_ && LOAD_CPU < nproc_ )) || die "PROXY_CPU=$PROXY_CPU / LOAD_CPU=$LOAD_CPU: this machine has $nproc_ CPUs"
    TMP="$(mktemp -d "${TMPDIR:-/tmp}/tollgate-tls.XXXXXX")"
    local ports; read -r -a ports <<< "$(free_ports 9)"
    PORT=([upstream]=${ports[0]} [nginx-http]=${ports[1]} [nginx-h2c]=${ports[2]} [nginx-tls]=${ports[3]}
          [tg-http]=${ports[4]} [tg-h2c]=${ports[4]} [tg-admin]=${ports[5]} [tg-tls]=${ports[6]} [tgs-admin]=${ports[7]})
    local q0 q1 quiet
    q0="$(core_sample)"; sleep 1; q1="$(core_sample)"
    quiet="$(awk -v c0="$q0" -v c1="$q1" -v p="$PROXY_CPU" -v l="$LOAD_CPU" 'BEGIN { split(c0, a, " "); split(c1, b, " ")
        printf "core %d %.0f%% busy, core %d %.0f%% busy", p, (b[1] - a[1]) / (b[2] - a[2]) * 100, l, (b[3] - a[3]) / (b[4] - a[4]) * 100 }')"
    local load_avg; load_avg="$(cut -d' ' -f1-3 /proc/loadavg)"

    # The certificate both proxies serve, for 127.0.0.1 and localhost: ECDSA P-256, or RSA-2048.
    local newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
    [[ "$CERT" == rsa ]] && newkey=(-newkey rsa:2048)
    openssl req -x509 "${newkey[@]}" -nodes -days 2 \
        -subj /CN=localhost -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
        -keyout "$TMP/key.pem" -out "$TMP/cert.pem" > "$TMP/openssl.log" 2>&1 || die "openssl req: $(cat "$TMP/openssl.log")"

    log "starting upstream, nginx, tollgate (plain: http + h2c), tollgate (TLS) (temp dir $TMP)"
    start_nginx upstream "$LOAD_CPU" upstream.nginx.conf PORT="${PORT[upstream]}"
    PID[upstream]=$SPAWNED
    wait_http upstream "$SPAWNED" "http://127.0.0.1:${PORT[upstream]}/"
    start_nginx nginx "$PROXY_CPU" tls.nginx.conf PORT="${PORT[nginx-http]}" H2C_PORT="${PORT[nginx-h2c]}" \
        TLS_PORT="${PORT[nginx-tls]}" UPSTREAM_PORT="${PORT[upstream]}"
    PID[nginx]=$SPAWNED
    wait_http nginx "$SPAWNED" "http://127.0.0.1:${PORT[nginx-http]}/"
    start_tollgate tg tollgate-proxy.yaml "${PORT[tg-http]}" "${PORT[tg-admin]}"
    start_tollgate tgs tollgate-tls.yaml "${PORT[tg-tls]}" "${PORT[tgs-admin]}"

    # Sanity: every URL answers 200 over the protocol it is for; TLS 1.3, X25519 and
    # AES-128-GCM are what both negotiate.
    local s k code tlsinfo=""
    for s in nginx tg; do
        code="$(curl -s -o /dev/null -m 2 -w '%{http_code} %{http_version}' "$(target_url $s http)")"
        [[ "$code" == "200 1.1" ]] || die "$s http: $code"
        code="$(curl -s -o /dev/null -m 2 -w '%{http_code} %{http_version}' --http2-prior-knowledge "$(target_url $s h2c)")"
        [[ "$code" == "200 2" ]] || die "$s h2c: $code"
        for k in 1.1 2; do
            code="$(curl -sk -o /dev/null -m 2 -w '%{http_code} %{http_version}' --http$k "https://127.0.0.1:${PORT[$s-tls]}/")"
            [[ "$code" == "200 $k" ]] || die "$s https (HTTP/$k): $code"
        done
        local hs; hs="$(openssl s_client -connect "127.0.0.1:${PORT[$s-tls]}" -alpn http/1.1 < /dev/null 2>&1)"
        local proto cipher group
        # "New, TLSv1.3, Cipher is TLS_AES_128_GCM_SHA256"
        proto="$(awk -F', ' '/^New, / { print $2; exit }' <<< "$hs")"
        cipher="$(awk '/^New, / { print $NF; exit }' <<< "$hs")"
        group="$(awk -F': ' '/^Server Temp Key/ { print $2; exit }' <<< "$hs")"
        [[ "$proto" == TLSv1.3 && "$cipher" == TLS_AES_128_GCM_SHA256 && "$group" == X25519* ]] \
            || die "$s negotiated '$proto' '$cipher' '$group', not TLSv1.3 TLS_AES_128_GCM_SHA256 X25519"
        tlsinfo+="$s: $proto $cipher ${group%%,*}; "
    done

    local est=$(( ${#KIND_LIST[@]} * 2 * (ROUNDS * (DURATION + 2) + (WARMUP > 0 ? WARMUP + 1 : 0)) ))
    log "${#KIND_LIST[@]} kinds x 2 servers x $ROUNDS rounds x ${DURATION}s: about ${est}s"
    if (( WARMUP > 0 )); then
        for k in "${KIND_LIST[@]}"; do
            for s in nginx tg; do run "$s" "$k" "$WARMUP" "$TMP/warmup-$s-$k.txt" > /dev/null; done
        done
    fi
    local results="$TMP/results.tsv" r cpu parsed order
    : > "$results"
    for ((r = 1; r <= ROUNDS; r++)); do
        for k in "${KIND_LIST[@]}"; do
            if (( r % 2 )); then order=(nginx tg); else order=(tg nginx); fi
            for s in "${order[@]}"; do
                local f="$TMP/round$r-$s-$k.txt"
                cpu="$(run "$s" "$k" "$DURATION" "$f")"
                parsed="$(parse "$f" "$k")" || die "cannot parse the output of $s $k: $(tail -5 "$f")"
                # s_time's own clock counts whole seconds: the rate is over the run's time.
                [[ $k == full ]] && parsed="$(awk -v p="$parsed" -v el="${cpu##* }" 'BEGIN { split(p, f, " "); f[1] = sprintf("%.2f", f[4] / el); print f[1], f[2], f[3], f[4], f[5], f[6] }')"
                if [[ "$k" == h2 ]] && ! grep -q '^Application protocol: h2' "$f"; then die "$s h2: h2load did not negotiate h2: $(grep -i protocol "$f")"; fi
                printf '%s\t%s\t%s\t%s\n' "$r" "$s-$k" "$(tr ' ' '\t' <<< "$parsed")" "$(tr ' ' '\t' <<< "$cpu")" >> "$results"
                log "round $r $s $k: $parsed | $cpu"
            done
        done
    done

    # results.tsv: round target rps p50 p99 reqs non2xx errors srv% core0% core1% other% seconds
    col() { awk -F'\t' -v t="$1" -v c="$2" '$2 == t { print $c }' "$results" | median; }
    sum() { awk -F'\t' -v t="$1" -v c="$2" '$2 == t { n += $c } END { printf "%d\n", n }' "$results"; }
    local commit dirty=""
    commit="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    [[ -n "$(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null)" ]] && dirty=" (plus uncommitted changes under src/ or Cargo.*)"
    echo
    echo "tollgate tls: tollgate next to nginx over TLS and HTTP/2, same run, same machine"
    echo "command   : $INVOKED   (DURATION=$DURATION ROUNDS=$ROUNDS CONNECTIONS=$CONNECTIONS H2=${H2_CONNECTIONS}x$H2_STREAMS CERT=$CERT KINDS=\"$KINDS\")"
    echo "commit    : $commit$dirty"
    echo "date      : $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host      : $nproc_ CPUs ($(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo)), Linux $(uname -r); before start: $quiet, load average $load_avg"
    echo "versions  : $("$TOLLGATE_BIN" --version), $(nginx -v 2>&1 | sed 's/^nginx version: //') on $(openssl version | awk '{ print $1, $2 }'), $(wrk -v 2>&1 | awk 'NR == 1 { print $1, $2 }'), $(h2load --version | head -1)"
    echo "tls       : $([[ $CERT == rsa ]] && echo RSA-2048 || echo ECDSA P-256) certificate; ${tlsinfo% }"
    echo "core $PROXY_CPU    : the proxy alone: nginx (worker_processes 1) | tollgate (TOKIO_WORKER_THREADS=1, RUST_LOG=warn)"
    echo "core $LOAD_CPU    : the load tool (wrk -t1 -c$CONNECTIONS | h2load -t1 -c$H2_CONNECTIONS -m$H2_STREAMS | openssl s_time -new) and the upstream (nginx, return 200)"
    echo "figures   : median of $ROUNDS interleaved round(s); h2 rows: latency = h2load's mean; full: rate = handshakes per second of one"
    echo "            client at a time; srv% = the server's CPU (% of one core); us/req = srv% / rate, the server's CPU per request"
    echo
    printf "%-12s %-22s %10s %8s %8s %6s %8s %6s %6s %6s\n" server traffic "req/s" "p50 ms" "p99 ms" "srv%" "us/req" "core$PROXY_CPU%" "core$LOAD_CPU%" "other%"
    declare -A RPS P99 US
    local t
    for k in "${KIND_LIST[@]}"; do
        for s in nginx tg; do
            t="$s-$k"
            RPS[$t]="$(col "$t" 3)"; P99[$t]="$(col "$t" 5)"
            local srv; srv="$(col "$t" 9)"
            US[$t]="$(awk -v p="$srv" -v r="${RPS[$t]}" 'BEGIN { printf "%.2f", (r > 0 ? p / 100 / r * 1e6 : 0) }')"
            printf "%-12s %-22s %10.0f %8.3f %8s %6.1f %8s %6.0f %6.0f %6.0f\n" "$([[ $s == tg ]] && echo tollgate || echo nginx)" "${KIND_LABEL[$k]}" \
                "${RPS[$t]}" "$(col "$t" 4)" "$([[ $k == h2* || $k == full ]] && echo - || printf '%.3f' "${P99[$t]}")" "$srv" "${US[$t]}" \
                "$(col "$t" 10)" "$(col "$t" 11)" "$(col "$t" 12)"
        done
    done
    echo
    local failed=0 unsound=0 v
    printf "%-36s %9s %10s %12s   %s\n" "tollgate / nginx" "req/s" "p99" "CPU/req" "goal (req/s)"
    for k in "${KIND_LIST[@]}"; do
        v="$(awk -v a="${RPS[tg-$k]}" -v b="${RPS[nginx-$k]}" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')"
        local p99r="-" cpur res=""
        [[ $k == h2* || $k == full ]] || p99r="$(awk -v a="${P99[tg-$k]}" -v b="${P99[nginx-$k]}" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')"
        cpur="$(awk -v a="${US[tg-$k]}" -v b="${US[nginx-$k]}" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')"
        if [[ "${GOAL[$k]}" == - ]]; then
            res="(information)"
        elif awk -v v="$v" -v g="${GOAL[$k]}" 'BEGIN { exit !(v >= g) }'; then
            res=">= ${GOAL[$k]} PASS"
        else
            res=">= ${GOAL[$k]} FAIL"; failed=1
        fi
        printf "%-36s %9s %10s %12s   %s\n" "${KIND_LABEL[$k]}" "$v" "$p99r" "$cpur" "$res"
    done
    echo "(p99 and CPU/req: lower is better for tollgate; CPU/req is the ratio of the us/req column)"
    echo
    check() { if [[ "$1" == 1 ]]; then printf 'check ok   : %s\n' "$2"; else printf 'check FAIL : %s\n' "$2"; unsound=1; fi; }
    for k in "${KIND_LIST[@]}"; do
        [[ $k == full ]] && continue
        for s in nginx tg; do
            t="$s-$k"
            local n2 er rq
            n2="$(sum "$t" 7)"; er="$(sum "$t" 8)"; rq="$(sum "$t" 6)"
            check "$([[ $n2 == 0 && $er == 0 && $rq -gt 0 ]] && echo 1)" "$t: $rq requests, non-2xx $n2, socket/stream errors $er"
        done
    done
    local worst; worst="$(awk -F'\t' '$12 > m { m = $12 } END { print m + 0 }' "$results")"
    if (( worst <= 10 )); then
        printf 'check ok   : quiet machine: other processes took at most %s%% CPU during any run\n' "$worst"
    else
        printf 'check WARN : other processes took up to %s%% CPU during a run (other%%): the figures are noisy\n' "$worst"
    fi
    echo
    if (( unsound )); then log "a sanity check failed: the figures above are not a valid comparison"; exit 2; fi
    (( failed )) && exit 1
    exit 0
}

main
