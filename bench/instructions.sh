#!/usr/bin/env bash
# bench/instructions.sh — user-space instructions per request, counted by callgrind.
#
#   bench/instructions.sh                          # target/release/tollgate
#   TOLLGATE_BIN=/tmp/old-tollgate bench/instructions.sh
#   TARGETS="admit admit-overrides admit-shared" bench/instructions.sh
#   KEEP=1 bench/instructions.sh                   # keep the profiles, then e.g.
#   callgrind_annotate --inclusive=yes /tmp/tollgate-instructions.*/reject.*.1
#   TARGETS="https new h2 h2c" bench/instructions.sh   # TLS and HTTP/2 (bench/tls.sh's kinds)
#
# Why: on a shared 2-core VM, requests/s of the same binary moves by 10-20 % between runs
# (bench/load.sh), so a change of a few percent in the request path cannot be seen there.
# Instructions executed are nearly the same from run to run: this is the A/B for a change to
# the request path (build the old commit, copy its binary, run this with each). It counts
# tollgate's own user-space work only; the kernel's (the larger part, see bench/cpu.sh) is
# not in it, nor cache misses.
#
# Not run by default: `admit-key` is `admit` keyed by an API key header (wrk sends one) behind
# a trusted proxy; `admit-overrides` is `admit-key` with five inline overrides and a
# 1,000,000-entry overrides file that names the key (the cost of consumers' plans on the
# request path); `admit-shared` is `admit` drawing on a top-level shared limit;
# `admit-fixed` is `admit` on a fixed_window limit, `admit-calendar` the same on the calendar
# days of Europe/Berlin (`align: calendar`); `admit-slots` is `admit` with a local concurrency
# limit in place of the gcra one (a slot taken and given back per request), and `admit-quiet`
# is `admit` without RateLimit fields (`headers: false`), the like-for-like gcra figure next to
# `admit-slots`, whose limit sends none.
#
# For each target of bench/load.sh that needs no Redis (proxy, admit, reject): tollgate runs
# under `valgrind --tool=callgrind` (one runtime thread), wrk -t1 -c8 warms it up, the counts
# are zeroed, wrk runs DURATION seconds, the counts are dumped; instructions / requests wrk
# completed. The upstream is an nginx worker as in bench/load.sh. Needs valgrind, nginx, wrk.
# TARGETS picks them (default "proxy admit reject"); `global-admit`, `global-reserved` and
# `global-cold` (load.sh's strict global targets: one hot key, the same with reserve_ahead, or a
# new key per request through bench/load/cold.lua)
# also start a redis-server (no persistence), and count tollgate's side of Redis: building the
# call, the client, decoding, the batcher; the TLS and HTTP/2 ones, proxy's config
# over a certificate made here (ECDSA P-256) as bench/tls.sh's: https (wrk, keep-alive), new
# (wrk, `Connection: close`: a resumed TLS 1.3 handshake per request), h2 and h2c (h2load
# -c4 -m16, instructions per stream; needs h2load, from nghttp2-client).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
DURATION="${DURATION:-5}"
BIN="${TOLLGATE_BIN:-$REPO/target/release/tollgate}"
[[ -x "$BIN" ]] || { echo "instructions.sh: $BIN missing: cargo build --release" >&2; exit 2; }
TARGETS="${TARGETS:-proxy admit reject}"
tools=(valgrind callgrind_control nginx wrk curl python3)
[[ " $TARGETS " == *" h2"* ]] && tools+=(h2load)
[[ " $TARGETS " =~ " "(https|new|h2)" " ]] && tools+=(openssl)
for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null || { echo "instructions.sh: $tool missing (apt-get install valgrind nginx wrk nghttp2-client openssl)" >&2; exit 2; }
done

NAME=instructions
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"

UP=$(free_port)
mkdir -p "$TMP/up/tmp"/{client_body,proxy,fastcgi,uwsgi,scgi}
render upstream.nginx.conf "$TMP/up.conf" DIR="$TMP/up" PORT="$UP" USER_LINE="$(user_line)"
nginx -c "$TMP/up.conf" -g 'daemon off;' >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$UP/"

# The overrides file of `admit-overrides`: a million keys, the client's (127.0.0.1) among them.
if [[ " ${TARGETS:-} " == *" admit-overrides "* ]]; then
    python3 - "$TMP/consumers.yaml" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    for i in range(999_999):
        f.write(f"key-{i:07d}-{(i * 2654435761) % 2**40:010x}: {'other' if i % 3 else 'exempt'}\n")
    f.write("127.0.0.1: bench\n")
PY
fi

# The global targets' Redis.
REDIS_PORT=""
if [[ " $TARGETS " == *" global-"* ]]; then
    command -v redis-server >/dev/null || { echo "instructions.sh: redis-server missing (apt-get install redis-server)" >&2; exit 2; }
    REDIS_PORT=$(free_port)
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >"$TMP/redis.log" 2>&1 & PIDS+=($!)
    for _ in $(seq 100); do [[ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" == PONG ]] && break; sleep 0.1; done
    [[ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" == PONG ]] || { echo "instructions.sh: redis-server did not answer PING: $(tail -3 "$TMP/redis.log")" >&2; exit 2; }
fi

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=localhost -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
    -keyout "$TMP/key.pem" -out "$TMP/cert.pem" >/dev/null 2>&1 || true

echo "binary: $BIN"
printf '%-16s %10s %14s\n' target requests instr/request
for name in $TARGETS; do
    p=$(free_port); a=$(free_port)
    case "$name" in
        https) cfg=tollgate-tls.yaml; url="https://127.0.0.1:$p/"; load=(wrk -t1 -c8) ;;
        new) cfg=tollgate-tls.yaml; url="https://127.0.0.1:$p/"; load=(wrk -t1 -c8 -H "Connection: close") ;;
        h2) cfg=tollgate-tls.yaml; url="https://127.0.0.1:$p/"; load=(h2load -t1 -c4 -m16) ;;
        h2c) cfg=tollgate-proxy.yaml; url="http://127.0.0.1:$p/"; load=(h2load -t1 -c4 -m16) ;;
        *) cfg="tollgate-$name.yaml"; url="http://127.0.0.1:$p/"; load=(wrk -t1 -c8)
           [[ -f "$T/$cfg" ]] || { echo "instructions.sh: unknown target $name" >&2; exit 2; } ;;
    esac
    # The targets keyed by an API key: wrk sends one.
    [[ "$name" == admit-key || "$name" == admit-overrides ]] && load+=(-H "x-api-key: 127.0.0.1")
    # A new X-User, the limit's key, on every request.
    [[ "$name" == global-cold ]] && load+=(-s "$T/cold.lua")
    # h2load takes -D SECONDS, wrk -dSECONDSs.
    run_load() { if [[ ${load[0]} == h2load ]]; then "${load[@]}" -D "$1" "$url"; else "${load[@]}" -d"$1s" "$url"; fi; }
    render "$cfg" "$TMP/$name.yaml" PORT="$p" ADMIN_PORT="$a" UPSTREAM_PORT="$UP" DIR="$TMP" \
        OVERRIDES="$TMP/consumers.yaml" REDIS_PORT="$REDIS_PORT"
    TOKIO_WORKER_THREADS=1 RUST_LOG=warn valgrind --tool=callgrind \
        --callgrind-out-file="$TMP/$name.%p" "$BIN" run --config "$TMP/$name.yaml" \
        >"$TMP/$name.log" 2>&1 &
    vg=$!
    PIDS+=("$vg")
    # Loading a million-entry file under valgrind takes a while.
    wait_up "http://127.0.0.1:$a/healthz" 300
    run_load 2 >/dev/null
    callgrind_control -z "$vg" >/dev/null 2>&1
    out=$(run_load "$DURATION")
    callgrind_control -d "$vg" >/dev/null 2>&1
    kill "$vg"; wait "$vg" 2>/dev/null || true
    # wrk: "N requests in"; h2load: "requests: T total, S started, D done, N succeeded".
    reqs=$(awk '/requests in/ {print $1} /^requests:/ {print $8}' <<<"$out")
    ir=$(awk '/^totals:/ {print $2}' "$TMP/$name.$vg.1")
    (( ${reqs:-0} > 0 )) || { echo "instructions.sh: $name completed no request; see $TMP/$name.log" >&2; exit 2; }
    printf '%-16s %10d %14.0f\n' "$name" "$reqs" "$(python3 -c "print($ir / $reqs)")"
done
