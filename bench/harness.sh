# bench/harness.sh — what bench/load.sh and bench/tls.sh share: their log lines, and the
# cleanup that stops every server they started (nginx workers included) and removes the temp
# dir unless KEEP=1. Sourced, not run: the caller sets HARNESS (its name, for log lines) and
# KEEP first, appends each server's pid to PIDS and sets TMP once it has made the temp dir.

log() { printf '[%s %s] %s\n' "$HARNESS" "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 2; }

# ---------------------------------------------------------------- cleanup
PIDS=()        # every process we started (each one is the exec'd server itself)
TMP=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    local pid kids=() p
    for pid in "${PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            # nginx workers are children of the master: remember them, in case
            # the master has to be killed hard and leaves them behind.
            for p in $(pgrep -P "$pid" 2>/dev/null || true); do kids+=("$p"); done
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    local deadline=$((SECONDS + 5))
    for pid in "${PIDS[@]}" "${kids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [[ -n "$TMP" && -d "$TMP" ]]; then
        if [[ "$KEEP" == 1 ]]; then log "kept $TMP"; else rm -rf "$TMP"; fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM
