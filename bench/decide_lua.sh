#!/usr/bin/env bash
# bench/decide_lua.sh [REV] — prints decide's script exactly as tollgate sends it: the files
# script.rs's DECIDE_LUA includes, in its order, joined by "\n" as its concat! does (same bytes,
# same SHA), from the work tree, or from git revision REV. CONST=DECIDE_MANY_LUA prints
# decide_many's (the batcher's EVALSHA script) the same way. bench/load.sh and bench/script.sh
# read the order from script.rs through this, so a new part cannot be missed by one of them.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="${1:-}"
CONST="${CONST:-DECIDE_LUA}"
show() {
    if [[ -z $rev ]]; then cat "$REPO/src/limit/redis/$1"; else git -C "$REPO" show "$rev:src/limit/redis/$1"; fi
}
parts=$(show script.rs | sed -n "/^pub const $CONST:/,/^);/s/.*include_str!(\"\(lua\/[A-Za-z0-9_.-]*\)\").*/\1/p")
want=$(show script.rs | sed -n "/^pub const $CONST:/,/^);/p" | grep -c 'include_str!' || true)
if [[ -z $parts || $(wc -w <<<"$parts") -ne $want ]]; then
    echo "decide_lua.sh: read [$parts] of the $want $CONST parts in script.rs${rev:+ at $rev}" >&2
    exit 1
fi
first=1
for f in $parts; do
    [[ $first == 1 ]] || printf '\n'
    first=0
    show "$f"
done
