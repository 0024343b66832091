#!/usr/bin/env bash
# bench/overrides.sh — what a 1,000,000-entry overrides file costs the process: start-up
# (config loaded, /readyz answering), reload (POST /admin/reload, which reads the file again),
# and resident memory, each against the same config without the file.
#
#   bench/overrides.sh                       # target/release/tollgate, 1,000,000 entries
#   ENTRIES=10000000 bench/overrides.sh
#
# Wall times move with the machine's load; the CPU columns (user + system of the process, from
# /proc/PID/stat, the least of RELOADS reloads) much less. The file is what an export writes: one `key-NNNNNNN-hhhhhhhhhh: PLAN` line per consumer
# (about 30 bytes a line), two thirds on a plan, one third exempt. RSS is VmRSS of
# /proc/PID/status once the gateway is ready (and VmHWM, the peak, after the reloads): the
# table and everything the load left behind. The request-path cost is measured by
# `cargo bench --bench overrides` and `TARGETS=... bench/instructions.sh`.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BIN="${TOLLGATE_BIN:-$REPO/target/release/tollgate}"
ENTRIES="${ENTRIES:-1000000}"
RELOADS="${RELOADS:-3}"
[[ -x "$BIN" ]] || { echo "overrides.sh: $BIN missing: cargo build --release" >&2; exit 2; }

NAME=overrides
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"

python3 - "$TMP/consumers.yaml" "$ENTRIES" <<'PY'
import sys
n = int(sys.argv[2])
with open(sys.argv[1], "w") as f:
    for i in range(n):
        f.write(f"key-{i:07d}-{(i * 2654435761) % 2**40:010x}: {'exempt' if i % 3 == 0 else 'pro'}\n")
PY

config() { # WITH_FILE PORT ADMIN
    cat <<YAML
server:
  listen: 127.0.0.1:$2
  admin: 127.0.0.1:$3
plans:
  pro: { rate: 600/1m }
routes:
  - name: api
    upstream: http://127.0.0.1:9
    limits:
      - name: per-key
        key: [header:x-api-key]
        rate: 60/1m
YAML
    [[ "$1" == yes ]] && echo "        overrides_file: $TMP/consumers.yaml"
    return 0
}

kb() { awk -v f="$2" '$1 == f":" {print $2}' "/proc/$1/status"; }
# CPU time (user + system) the process has used, in ms: unlike wall time, hardly moved by
# what else the machine runs.
cpu_ms() { python3 -c "import os; f=open('/proc/$1/stat').read().rsplit(')',1)[1].split(); print(round((int(f[11])+int(f[12]))*1000/os.sysconf('SC_CLK_TCK')))"; }
ms() { python3 -c "import time; print(int(time.monotonic() * 1000))"; }

printf '%-6s %9s %8s %9s %10s %10s %9s %11s\n' file start_ms start_cpu reload_ms reload_cpu rss_MiB peak_MiB bytes/entry
base_rss=0
for with in no yes; do
    p=$(free_port); a=$(free_port)
    config "$with" "$p" "$a" > "$TMP/routes-$with.yaml"
    t0=$(ms)
    RUST_LOG=warn "$BIN" run --config "$TMP/routes-$with.yaml" >"$TMP/$with.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    wait_up "http://127.0.0.1:$a/readyz" 120
    start=$(( $(ms) - t0 ))
    start_cpu=$(cpu_ms "$pid")
    rss=$(kb "$pid" VmRSS)
    best=""
    best_cpu=""
    for _ in $(seq "$RELOADS"); do
        c0=$(cpu_ms "$pid")
        t=$(curl -s -o /dev/null -w '%{time_total}' -X POST "http://127.0.0.1:$a/admin/reload")
        c=$(( $(cpu_ms "$pid") - c0 ))
        t=$(python3 -c "print(round($t * 1000))")
        [[ -z "$best" || "$t" -lt "$best" ]] && best=$t
        [[ -z "$best_cpu" || "$c" -lt "$best_cpu" ]] && best_cpu=$c
    done
    peak=$(kb "$pid" VmHWM)
    kill "$pid"; wait "$pid" 2>/dev/null || true
    per=""
    if [[ "$with" == yes ]]; then
        per=$(python3 -c "print(round(($rss - $base_rss) * 1024 / $ENTRIES, 1))")
    else
        base_rss=$rss
    fi
    printf '%-6s %9d %8d %9d %10d %10.1f %9.1f %11s\n' "$with" "$start" "$start_cpu" "$best" \
        "$best_cpu" "$(python3 -c "print($rss / 1024)")" "$(python3 -c "print($peak / 1024)")" "$per"
done
echo "entries: $ENTRIES ($(du -h "$TMP/consumers.yaml" | cut -f1) file)"
