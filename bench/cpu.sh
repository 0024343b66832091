#!/usr/bin/env bash
# bench/cpu.sh — CPU time per request, user and kernel, of nginx and tollgate as the same proxy.
#
#   bench/cpu.sh            # ROUNDS=4 DURATION=3
#
# Requests/s says which proxy is faster; this says where each one's time goes. Same layout as
# bench/load.sh (the proxy alone on core 0, wrk and the upstream on core 1, 64 connections):
# for each run, the proxy process's utime and stime from /proc/PID/stat before and after a wrk
# run, divided by the requests wrk completed. Targets: nginx proxy, tollgate proxy (no
# limits), tollgate admit (one local limit that admits everything), tollgate reject (429 to
# everything), interleaved ROUNDS times. Prints each run and the median per target.
# Needs nginx and wrk (bench/load.sh installs them); uses target/release/tollgate as built.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
ROUNDS="${ROUNDS:-4}"
DURATION="${DURATION:-3}"
BIN="${TOLLGATE_BIN:-$REPO/target/release/tollgate}"
[[ -x "$BIN" ]] || { echo "cpu.sh: $BIN missing: cargo build --release" >&2; exit 2; }
for tool in nginx wrk taskset python3; do
    command -v "$tool" >/dev/null || { echo "cpu.sh: $tool missing" >&2; exit 2; }
done

NAME=cpu
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"

UP=$(free_port)
mkdir -p "$TMP/up/tmp"/{client_body,proxy,fastcgi,uwsgi,scgi} "$TMP/ng/tmp"/{client_body,proxy,fastcgi,uwsgi,scgi}
render upstream.nginx.conf "$TMP/up.conf" DIR="$TMP/up" PORT="$UP" USER_LINE="$(user_line)"
taskset -c 1 nginx -c "$TMP/up.conf" -g 'daemon off;' >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$UP/"

declare -A PORT PID
NG=$(free_port)
render proxy.nginx.conf "$TMP/ng.conf" DIR="$TMP/ng" PORT="$NG" UPSTREAM_PORT="$UP" USER_LINE="$(user_line)"
taskset -c 0 nginx -c "$TMP/ng.conf" -g 'daemon off;' >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$NG/"
PORT[nginx]=$NG
PID[nginx]=$(pgrep -P "${PIDS[-1]}" | head -1)   # the one worker
for name in proxy admit reject; do
    p=$(free_port); a=$(free_port)
    render "tollgate-$name.yaml" "$TMP/$name.yaml" PORT="$p" ADMIN_PORT="$a" UPSTREAM_PORT="$UP"
    TOKIO_WORKER_THREADS=1 RUST_LOG=warn taskset -c 0 "$BIN" run --config "$TMP/$name.yaml" >"$TMP/$name.log" 2>&1 &
    PIDS+=($!); PID[$name]=$!; PORT[$name]=$p
    wait_up "http://127.0.0.1:$a/healthz"
done

TCK=$(getconf CLK_TCK)
echo "target  round  req/s  user_us/req  sys_us/req  total_us/req"
for round in $(seq "$ROUNDS"); do
    for name in nginx proxy admit reject; do
        url="http://127.0.0.1:${PORT[$name]}/"
        taskset -c 1 wrk -t1 -c64 -d1s "$url" >/dev/null
        read -r u1 s1 < <(awk '{print $14, $15}' "/proc/${PID[$name]}/stat")
        out=$(taskset -c 1 wrk -t1 -c64 -d"${DURATION}s" "$url")
        read -r u2 s2 < <(awk '{print $14, $15}' "/proc/${PID[$name]}/stat")
        reqs=$(awk '/requests in/ {print $1}' <<<"$out")
        rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
        python3 -c "r=$reqs; u=($u2-$u1)/$TCK/r*1e6; s=($s2-$s1)/$TCK/r*1e6; print(f'$name $round {float($rps):.0f} {u:.2f} {s:.2f} {u+s:.2f}')"
    done
done | tee "$TMP/runs.txt"
echo
echo "median per target:"
python3 - "$TMP/runs.txt" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
for name in ["nginx", "proxy", "admit", "reject"]:
    rs = [r for r in rows if r[0] == name]
    col = lambda i: statistics.median(float(r[i]) for r in rs)
    print(f"{name:7s} req/s {col(2):8.0f}  user {col(3):5.2f} us  sys {col(4):5.2f} us  total {col(5):5.2f} us")
EOF
