# bench/lib.sh — what bench/cpu.sh and bench/instructions.sh share: a temp dir whose servers
# are killed on exit, free ports, the bench/load templates, waiting for a server to answer.
# Sourced, not run. The caller sets NAME (for messages) before sourcing.

T="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/load"
TMP="$(mktemp -d "/tmp/tollgate-$NAME.XXXXXX")"
PIDS=()
# KEEP=1 leaves the temp dir (configs, logs, callgrind's profiles) for a look afterwards.
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
    if [[ "${KEEP:-0}" == 1 ]]; then echo "$NAME.sh: kept $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
render() { # TEMPLATE OUT KEY=VALUE...
    local src="$T/$1" out="$2"; shift 2; local args=() kv
    for kv in "$@"; do args+=(-e "s|@${kv%%=*}@|${kv#*=}|g"); done
    sed "${args[@]}" "$src" > "$out"
}
user_line() { [[ "$(id -u)" == 0 ]] && echo "user root;" || echo ""; }
# wait_up URL [SECONDS]: until URL answers (10 s by default).
wait_up() {
    local tries=$(( ${2:-10} * 10 ))
    for _ in $(seq "$tries"); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done
    echo "$NAME.sh: $1 did not answer" >&2; exit 2
}
