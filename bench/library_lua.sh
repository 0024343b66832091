#!/usr/bin/env bash
# bench/library_lua.sh [REV] — prints the Redis function library exactly as tollgate loads it
# (FUNCTION LOAD): library.lua with each `--@ <file>` line replaced by that file, as script.rs's
# expand_library does, under the `#!lua name=` and `local LIB` lines naming it
# `tollgate_v<first 12 hex digits of the SHA-1 of the expanded code>`; from the work tree, or
# from git revision REV.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="${1:-}"
LUA=src/limit/redis/lua
TMP="$(mktemp -d /tmp/tollgate-library.XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
if [[ -z $rev ]]; then
    cp "$REPO/$LUA"/*.lua "$TMP/"
else
    for f in $(git -C "$REPO" ls-tree --name-only "$rev" "$LUA/"); do
        git -C "$REPO" show "$rev:$f" >"$TMP/$(basename "$f")"
    done
fi
[[ -f $TMP/library.lua ]] || { echo "library_lua.sh: no $LUA/library.lua${rev:+ at $rev}" >&2; exit 1; }
awk -v dir="$TMP" '
    /^--@ / {
        f = dir "/" $2
        if ((getline line < f) <= 0) { print "library_lua.sh: cannot read " $2 > "/dev/stderr"; exit 1 }
        do print line; while ((getline line < f) > 0)
        close(f)
        next
    }
    { print }' "$TMP/library.lua" >"$TMP/code"
name="tollgate_v$(sha1sum "$TMP/code" | cut -c1-12)"
printf '#!lua name=%s\nlocal LIB = '"'"'%s'"'"'\n' "$name" "$name"
cat "$TMP/code"
